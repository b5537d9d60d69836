"""The LLM judge: ``client`` scores trajectories through any OpenAI-compatible endpoint (a hosted
model, vLLM, ``flowopt serve``), cached by content; ``resources/judge.py`` configures it."""
