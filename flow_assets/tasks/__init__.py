"""Tasks with verifiers: where the training and held-out queries come from and how answers are scored.

``sources`` holds the two sources (reasoning-gym generators and JSONL files), the deterministic
train / held-out split by task id, the prompt template that turns a query into the policy's input
text, and the demonstration answers used for the supervised warm start.
"""
