"""The vLLM engine (``sampler.engine = "vllm"``): ``options`` (its ``[sampler.vllm]`` section;
torch-free), ``engine``, ``sleep``, ``lora``, and in vLLM's engine process ``worker`` and
``transfer``."""
