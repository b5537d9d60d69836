"""The policy: the model that takes the agent's decisions, and the pure ML code around it.

No Dagster import lives here. Modules, one concept each:

- ``configs``: the settings of the modules below and the records they hand on, as plain dataclasses
  (no torch: the code location builds its run configs from them).
- ``tokenizer``: a character-level tokenizer saved as a Hugging Face tokenizer directory.
- ``tiny_model``: a tiny Llama-style causal LM for CPU tests and the demo, saved with ``save_pretrained``.
- ``lora``: wrap a base model with a PEFT LoRA adapter; save and load adapter directories.
- ``sampling``: batched rollouts (token ids in, token ids out) with behaviour log-probs, and
  teacher-forced log-probs of given completions.
- ``sft``: supervised warm start on (prompt, answer) demonstrations.
- ``trainer``: one GRPO training round with checkpoints, best-k retention and resume.
- ``prompt``: prompt policies (instructions, demonstrations, tool descriptions), a policy in the context.
- ``prompt_search``: few-shot demonstrations from successful flows, chosen by random search.
"""
