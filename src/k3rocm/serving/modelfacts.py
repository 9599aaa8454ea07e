"""Facts about the served model's architecture that the settings and the base checks share.

Kimi-K3 (HF ``KimiK3ForConditionalGeneration``, text config ``kimi_linear``) has 96 attention
heads: ``text_config.num_attention_heads`` of its ``config.json`` (the census test data carries
that file, ``tests/data/census/models/kimi-k3/config.json``; a test keeps the two equal).
Stdlib only, imports nothing.
"""

KIMI_K3_HEADS = 96
