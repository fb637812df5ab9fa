"""An emulated vLLM server: the simulator's engine in wall-clock time behind the OpenAI API."""
