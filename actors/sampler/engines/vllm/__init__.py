"""The vLLM engine (``sampler.engine = "vllm"``; its options are its row's,
``actors/runtime/config/engines.py``): ``engine``, ``sleep``, ``lora``, and in vLLM's engine
process ``worker`` and ``transfer``."""
