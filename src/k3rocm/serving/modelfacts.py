"""Facts about the served model's architecture that the settings and the base checks share.

Kimi-K3 (HF ``KimiK3ForConditionalGeneration``, text config ``kimi_linear``): 96 attention
heads (``num_attention_heads`` of the checkpoint's ``config.json``; vLLM PR #57640's
"12 heads per rank at TP=8"). Stdlib only, imports nothing.
"""

KIMI_K3_HEADS = 96
