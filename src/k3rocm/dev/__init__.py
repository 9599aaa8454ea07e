"""Development without AMD GPUs: the CPU stand-in base images, the tiny random-weight MLA model,
the smoke run and the demo of the whole bundle."""
