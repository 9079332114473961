"""The vLLM engine (``sampler.engine = "vllm"``): ``engine``, ``options`` (availability, engine
arguments, sleep; torch-free), ``lora``, and in vLLM's engine process ``worker`` and
``transfer``."""
