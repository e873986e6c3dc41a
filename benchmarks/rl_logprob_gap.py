"""The rollout-vs-trainer log-prob gap, cause by cause, in one process (no Ray).

The GRPO job measures the gap end to end (jobs/grpo_tool_agent.py: every sampled token, by kind).
This takes the engines' computation apart on the job's own sequences (the lookup task's episodes,
the default tiny model after the job's format warm-up; every agent token, random keys and values
included) and compares each way an engine computes a token's log-prob with the trainer's
(`packed_logits` of whole sequences, 64 in one pass):

- prefill, one sequence alone (`DecoderModel.prefill`, the reference path);
- prefill packed with other sequences in one batch (`forward_layer_spans`: batch composition);
- prefill after KV of an earlier turn (the prompt's first 128 tokens cached, the rest computed:
  a hit turn; loaded KV is the stored bytes, so this is the computed-vs-cached split);
- a decode step over paged KV, one sequence and a batch of 16 of two lengths (`forward_layer_paged`
  with its padding mask);
- each at temperature 1.0 and 0.7 (the job's log-prob is log-softmax(logits / T));
- the trainer on 1 and on 2 torch threads (the trainer against itself).

    .venv/bin/python benchmarks/rl_logprob_gap.py --json benchmarks/results/rl_logprob_gap.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dualpath_ray.config import DualPathConfig  # noqa: E402
from dualpath_ray.model.llama import DecoderModel  # noqa: E402
from dualpath_ray.model.training import packed_logits  # noqa: E402
from dualpath_ray.rl.grpo import logprob_gap  # noqa: E402
from dualpath_ray.rl.lookup_task import LookupTask  # noqa: E402
from dualpath_ray.rl.policy import Policy  # noqa: E402

BLOCK = 16


def log_probs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.log_softmax(logits.float() / temperature, dim=-1).gather(1, tokens[:, None])[:, 0]


def spans_prefill(model: DecoderModel, prompts: list[list[int]], cached: int) -> torch.Tensor:
    """Last-row logits of each prompt, prefilled in one packed batch after `cached` tokens each."""
    kv_shape = (2, model.cfg.n_kv_head, model.cfg.head_dim)
    window = [torch.zeros((sum(len(p) for p in prompts), *kv_shape)) for _ in range(model.n_layer)]
    offsets = list(np.cumsum([0, *[len(p) for p in prompts]])[:-1])
    if cached:
        for prompt, off in zip(prompts, offsets):
            past = model.prefill(prompt[:cached]).kv
            for layer in range(model.n_layer):
                window[layer][off : off + cached] = past[layer]
    ids = torch.tensor([t for p in prompts for t in p[cached:]])
    positions = torch.cat([torch.arange(cached, len(p)) for p in prompts])
    counts = [len(p) - cached for p in prompts]
    hidden = model.embed(ids)
    for layer in range(model.n_layer):
        spans = [window[layer][off : off + len(p)] for p, off in zip(prompts, offsets)]
        hidden = model.forward_layer_spans(layer, hidden, positions, spans, counts)
    return model.logits(hidden[torch.tensor(np.cumsum(counts) - 1)])


def paged_decode(model: DecoderModel, prompts: list[list[int]]) -> torch.Tensor:
    """Logits after each prompt's last token, one decode step of the whole batch over paged KV."""
    pages_each = max(len(p) for p in prompts) // BLOCK + 1
    pool = torch.zeros((len(prompts) * pages_each, model.n_layer, BLOCK, 2, model.cfg.n_kv_head, model.cfg.head_dim))
    tables = [list(range(i * pages_each, (i + 1) * pages_each)) for i in range(len(prompts))]
    for prompt, table in zip(prompts, tables):
        kv = model.prefill(prompt[:-1]).kv
        for layer in range(model.n_layer):
            for t in range(len(prompt) - 1):
                pool[table[t // BLOCK], layer, t % BLOCK] = kv[layer][t]
    positions = torch.tensor([len(p) - 1 for p in prompts])
    hidden = model.embed(torch.tensor([p[-1] for p in prompts]))
    for layer in range(model.n_layer):
        hidden = model.forward_layer_paged(layer, hidden, positions, pool[:, layer], torch.tensor(tables), positions + 1)
    return model.logits(hidden)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--sequences", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = DualPathConfig()
    task = LookupTask(cfg.model.vocab_size)
    policy = Policy(cfg.model, 3e-3, 1.0, "sampling")
    rng = np.random.default_rng(0)
    for _ in range(60):  # the job's warm-up: the model the first step rolls out with
        examples = [task.format_example(rng) for _ in range(32)]
        policy.warm_up([e[0] for e in examples], [e[1] for e in examples], 1.0)
    model = DecoderModel(cfg.model)
    model.load_weights(policy.state())
    sequences = [task.format_example(rng)[0] for _ in range(args.sequences)]
    prompt_len = len(sequences[0]) - 6
    # Every agent token (random keys and values: low-probability tokens too), by how an engine
    # computes it: the first token of each turn in a prefill, the second in a decode step.
    firsts = [(i, p) for i in range(len(sequences)) for p in (prompt_len, prompt_len + 4)]
    seconds = [(i, p) for i in range(len(sequences)) for p in (prompt_len + 1, prompt_len + 5)]
    starts = np.cumsum([0, *[len(s) for s in sequences]])[:-1]

    def trainer_rows(which: list[tuple[int, int]], threads: int) -> torch.Tensor:
        torch.set_num_threads(threads)
        with torch.no_grad():
            rows = packed_logits(model, sequences)[torch.tensor([int(starts[i]) + p - 1 for i, p in which])]
        torch.set_num_threads(1)
        return rows

    def prefixes(which: list[tuple[int, int]]) -> list[list[int]]:
        return [sequences[i][:p] for i, p in which]

    turn1 = [(i, p) for i, p in firsts if p > prompt_len]
    engine = {
        "prefill, one sequence alone": (firsts, torch.cat([model.prefill(q, last_only=True).logits for q in prefixes(firsts)])),
        "prefill, packed with 63 others": (firsts, torch.cat([spans_prefill(model, prefixes(firsts[j : j + 64]), 0)
                                                              for j in range(0, len(firsts), 64)])),
        "prefill, 128 tokens cached (a hit turn)": (turn1, spans_prefill(model, prefixes(turn1), 128)),
        "decode step, batch of 1": (seconds, torch.cat([paged_decode(model, [q]) for q in prefixes(seconds)])),
        "decode step, batch of 16, two lengths": (seconds, torch.cat([paged_decode(model, prefixes(seconds[j : j + 16]))
                                                                     for j in range(0, len(seconds), 16)])),
        "trainer on 2 threads (vs 1)": (firsts + seconds, trainer_rows(firsts + seconds, 2)),
    }
    results = {}
    for temperature in (1.0, 0.7):
        for cause, (which, logits) in engine.items():
            tokens = torch.tensor([sequences[i][p] for i, p in which])
            reference = log_probs(trainer_rows(which, 1), tokens, temperature)
            results[f"{cause}, T={temperature}"] = logprob_gap(log_probs(logits, tokens, temperature), reference).as_dict()
    for name, stats in results.items():
        print(f"{name:50s} max {stats['max']:.2e}  p99 {stats['p99']:.2e}  mean {stats['mean']:.2e}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"sequences": args.sequences, "model": cfg.model.model_dump(mode="json"),
                                     "torch": torch.__version__, "gaps": results}, indent=2))


if __name__ == "__main__":
    main()
