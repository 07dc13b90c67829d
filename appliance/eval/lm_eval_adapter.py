"""lm-evaluation-harness 0.4's model interface over our model at any parallel layout (`--model bloom-appliance`).

What BLOOM's Megatron-DeepSpeed did with `tasks/eval_harness/evaluate.py` (an `EvalHarnessAdaptor(lm_eval.base.LM)`
that ran the harness's requests through the pipeline engine), for lm-eval 0.4: `ApplianceLM` is a registered
`TemplateLM` whose three request types go through a TaskModel (appliance/eval/harness.py), the two functions any
layout serves: `target_logprobs` (the vocabulary-parallel scores of parallel/tensor/cross_entropy.py under tensor
parallelism, the pipeline's last stage broadcasting them; parallel/step/scoring.py) and `next_tokens`.

Every rank runs the same harness code on the same requests (lm-eval sees one process: rank 0 of 1). The adapter
then deals the requests over the data-parallel group and gathers the answers back (appliance/eval/scoring.py), so
every rank returns every result and makes the same collective calls in the same order; the TP x PP ranks of one
replica receive the same batches. lm-eval itself never sees the layout.

Requests are tokenized as lm-eval's `hf` backend tokenizes them (TemplateLM's own `_encode_pair`: a trailing space
of the context moves to the continuation; the continuation is encode(context + continuation) after encode(context))
and cut as it cuts them: the last max_length + 1 tokens of context + continuation, the continuation's tokens scored.
Generation is greedy (the harness's `do_sample: false`), at most max_gen_toks tokens, the prompt keeping its last
max_length - max_gen_toks tokens, stopped at `until` or </s> and cut at the first stop string, as `hf` does.

One difference from `hf`, on purpose: an empty context (rolling log-likelihoods, i.e. perplexity tasks) is
conditioned on </s>, the document boundary the model was trained with, where `hf` takes the tokenizer's <s>.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from lm_eval import utils as lm_eval_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from appliance.eval.harness import TaskModel, TextCodec
from appliance.eval.scoring import generate_greedy, score_log_likelihoods
from appliance.eval.tasks import DEFAULT_MAX_GEN_TOKS

MODEL_NAME = "bloom-appliance"
# lm-eval's hf backend's default for generation tasks that name no max_gen_toks.


@register_model(MODEL_NAME)
class ApplianceLM(TemplateLM):
    """An lm-eval LM over a TaskModel. Collective over `group` (the data-parallel group; None = the default group):
    every rank must make the same calls.

    model: target_logprobs and next_tokens for this rank's replica (ModelScorer for a whole model, the engine's
    task_model() for a split one). codec: the run's tokenizer. max_length: the window, in tokens (the run's
    sequence length). batch_size: requests per forward pass on each data-parallel rank.
    """

    def __init__(
        self,
        model: TaskModel,
        codec: TextCodec,
        *,
        max_length: int,
        batch_size: int | str | None = 16,
        group: Any = None,
        **_harness_args: Any,  # device, max_batch_size: what simple_evaluate passes to every model; the layout decides
    ) -> None:
        super().__init__()
        if max_length < 2:
            raise ValueError(f"max_length must be at least 2 tokens (got {max_length})")
        self.task_model, self.codec, self.group = model, codec, group
        self._max_length = max_length
        # "auto" (lm-eval's probe for the largest batch that fits) has no meaning here: the layout fixed the memory.
        self._batch_size = int(batch_size) if isinstance(batch_size, int | str) and str(batch_size).isdigit() else 16

    # ---- what TemplateLM and the evaluator read ---------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.codec.eos_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def tokenizer_name(self) -> str:
        return MODEL_NAME

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return self.codec.encode(string)  # lm-eval's hf backend on our export adds no special tokens either

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.codec.decode(tokens)

    # ---- loglikelihood ---------------------------------------------------------------------------------------
    def _score(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        return score_log_likelihoods(
            self.task_model.target_logprobs,
            [(context or [self.prefix_token_id], continuation) for context, continuation in pairs],
            max_length=self._max_length,
            batch_size=self._batch_size,
            pad_id=self.codec.pad_id,
            group=self.group,
        )

    def _loglikelihood_tokens(
        self, requests: list[tuple[tuple[str, str], list[int], list[int]]], **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """(log p(continuation | context), greedy decoding produces it) per request, in request order."""
        results = self._score([(context, continuation) for _, context, continuation in requests])
        for (texts, _, _), result in zip(requests, results, strict=True):
            self.cache_hook.add_partial("loglikelihood", texts, result)
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """The whole text's log-likelihood in windows of max_length tokens, each token predicted once, every window
        but the first conditioned on the tokens before it (lm-eval's get_rolling_token_windows, context_len=1)."""
        windows: list[tuple[list[int], list[int]]] = []
        per_request: list[int] = []
        for (text,) in (request.args for request in requests):
            mine = [
                lm_eval_utils.make_disjoint_window(window)
                for window in lm_eval_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self._max_length,
                    context_len=1,
                )
            ]
            windows += mine
            per_request.append(len(mine))
        scores = self._score(windows)
        totals: list[float] = []
        start = 0
        for request, count in zip(requests, per_request, strict=True):
            totals.append(sum(ll for ll, _ in scores[start : start + count]))
            start += count
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, totals[-1])
        return totals

    # ---- generation --------------------------------------------------------------------------------------------
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, one generate_greedy call per distinct set of generation arguments."""
        answers: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for index, request in enumerate(requests):
            groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(index)
        for indices in groups.values():
            kwargs = normalize_gen_kwargs(requests[indices[0]].args[1], DEFAULT_MAX_GEN_TOKS)
            if kwargs.get("do_sample"):
                first = requests[indices[0]]
                raise ValueError(
                    f"{MODEL_NAME} decodes greedily; task {getattr(first, 'task_name', None)!r} asks for sampling"
                    f" ({first.args[1]})"
                )
            until = handle_stop_sequences(kwargs.get("until"), eos=self.codec.decode([self.eot_token_id]) or None)
            stops = [stop for stop in until if stop]
            texts = self._generate([requests[i].args[0] for i in indices], int(kwargs["max_gen_toks"]), stops)
            for index, text in zip(indices, texts, strict=True):
                answers[index] = text
                self.cache_hook.add_partial("generate_until", requests[index].args, text)
        return [answer or "" for answer in answers]

    def _generate(self, contexts: list[str], max_gen_toks: int, stops: list[str]) -> list[str]:
        eos = self.eot_token_id

        def is_done(tokens: list[int]) -> bool:
            return tokens[-1] == eos or any(stop in self.codec.decode(tokens) for stop in stops)

        outputs = generate_greedy(
            self.task_model.next_tokens,
            [self.tok_encode(context) or [self.prefix_token_id] for context in contexts],
            max_new_tokens=min(max_gen_toks, self._max_length - 1),
            max_length=self._max_length,
            is_done=is_done,
            batch_size=self._batch_size,
            pad_id=self.codec.pad_id,
            group=self.group,
        )
        return [postprocess_generated_text(self.codec.decode(tokens), stops, None) for tokens in outputs]
