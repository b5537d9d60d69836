"""The reinforcement-learning math, pure functions without Dagster or I/O: rewards
(``rewards``, ``reward_fns``), group advantages and turn pooling (``advantages``), credit
assignment (``credit``), the GRPO loss (``grpo_loss``, ``grpo_config``), held-out evaluation and its
statistics (``evaluation``, ``eval_stats``) and the promotion gate's rule (``gate``)."""
