"""vLLM rollouts behind the same interface as :func:`flow_assets.policy.sampling.sample_rollouts`.

Imported only when ``PolicyModel.backend == "vllm"`` (the optional ``gpu`` extra); vLLM needs a
GPU. The LoRA adapter is served with ``LoRARequest``, so the champion adapter is used without
merging. Behaviour log-probs are requested as ``processed_logprobs`` (after temperature scaling,
i.e. ``log_softmax(logits / T)``, the convention of ``sampling.py``; with ``top_p == 1`` they are
identical to what the transformers backend returns).
"""

from __future__ import annotations

from pathlib import Path

from flow_assets.policy.configs import Rollout, SamplingConfig


class VLLMSampler:
    """A vLLM engine on a base model, sampling with an optional LoRA adapter per call.

    Raises:
        ImportError: vLLM is not installed (``pip install -e '.[gpu]'``).
    """

    def __init__(self, base_model_path: str, max_lora_rank: int = 64, gpu_memory_utilization: float = 0.5):
        from vllm import LLM

        self._llm = LLM(
            model=base_model_path,
            enable_lora=True,
            max_lora_rank=max_lora_rank,
            gpu_memory_utilization=gpu_memory_utilization,
            logprobs_mode="processed_logprobs",
        )
        self._tokenizer = self._llm.get_tokenizer()
        self._lora_ids: dict[str, int] = {}

    def generate(
        self,
        adapter_path: str | None,
        prompt_ids: list[list[int]],
        config: SamplingConfig,
        temperatures: list[float] | None = None,
        top_ps: list[float] | None = None,
    ) -> list[Rollout]:
        """The gateway's entry point: prompts given as token ids (vLLM's ``TokensPrompt``), never
        re-encoded, each with its own temperature / top_p when given; otherwise as :meth:`sample`."""
        prompts = [{"prompt_token_ids": list(ids)} for ids in prompt_ids]
        return self.sample(prompts, config, adapter_path, temperatures, top_ps)

    def sample(
        self,
        prompts: list,
        config: SamplingConfig,
        adapter_path: str | None = None,
        temperatures: list[float] | None = None,
        top_ps: list[float] | None = None,
    ) -> list[Rollout]:
        """``len(prompts) * config.num_samples`` rollouts, prompt-major, with behaviour log-probs
        (``prompts``: texts, or ``{"prompt_token_ids": [...]}`` token prompts; ``temperatures`` /
        ``top_ps``: one per prompt, else the config's)."""
        from vllm import SamplingParams
        from vllm.lora.request import LoRARequest

        temperatures = temperatures or [config.temperature] * len(prompts)
        top_ps = top_ps or [config.top_p] * len(prompts)
        params = [
            SamplingParams(
                n=config.num_samples,
                temperature=t,
                top_p=p,
                max_tokens=config.max_new_tokens,
                logprobs=0,  # only the sampled token's log-prob
                seed=config.seed,
            )
            for t, p in zip(temperatures, top_ps)
        ]
        lora = None
        if adapter_path is not None:
            key = str(Path(adapter_path).resolve())
            lora_id = self._lora_ids.setdefault(key, len(self._lora_ids) + 1)
            lora = LoRARequest(f"adapter-{lora_id}", lora_id, key)
        outputs = self._llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
        eos = self._tokenizer.eos_token_id
        rollouts = []
        for i, out in enumerate(outputs):
            for j, comp in enumerate(out.outputs):
                ids = list(comp.token_ids)
                logprobs = [step[tok].logprob for step, tok in zip(comp.logprobs or [], ids)]
                error = None if len(logprobs) == len(ids) else "vLLM returned no log-prob for some tokens"
                rollouts.append(
                    Rollout(
                        prompt_index=i,
                        sample_index=j,
                        prompt=prompts[i] if isinstance(prompts[i], str) else "",
                        prompt_ids=list(out.prompt_token_ids),
                        completion_ids=ids if error is None else [],
                        completion_text=comp.text,
                        logprobs=logprobs if error is None else [],
                        finished=bool(ids) and ids[-1] == eos,
                        error=error,
                    )
                )
        return rollouts
