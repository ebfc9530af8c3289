"""Throughput of multi-turn (agentic) rollouts (``task.env``) on the tiny model: model tokens a second of
``Job.collect_rollouts`` with a scripted tool environment, with and without tool latency, in the same process.

    python tools/bench_multiturn.py                     # 8 prompts x 2 samples, 3 repeats
    python tools/bench_multiturn.py --prompts 16 --repeats 5 --latency 0.2
    python tools/bench_multiturn.py --quick             # 4 prompts x 2 samples, 1 repeat, one engine (tests)
    python tools/bench_multiturn.py --slots 4           # 4 decode slots an engine for its 8 conversations: evictions

The job is the default tiny one (``model: tiny``, CPU, the character tokenizer, so ``task.tool_format`` is
``plain``) with ``rollout.max_prompt_length=12`` and actor-gen dp 2 (the tests' shape), built from random
parameters (``init_params`` at ``trainer.seed``, no warm start; throughput does not need a trained policy), with
``task.env=bench_multiturn:FixedToolEnv``: every trajectory has exactly 4 assistant turns, the first three each
answered by a tool message of K digits, K drawn in [32, 128] from a generator seeded by the row's problem text
and the turn (so every run and every repeat sees the same tool outputs), the fourth ended by the environment.
A tool call sleeps ``FixedToolEnv.latency`` seconds.

A random policy rarely samples the end-of-sequence token (about 1 in the vocabulary's 128), so a turn would run
until the response budget and the trajectory would end after one turn. The benchmark therefore raises the
end-of-sequence logit of the random parameters (``--eos-logit``: a constant dimension in every token embedding,
read by the eos column of the language-model head; everything else stays random), so a turn stops after about
``--turn-tokens`` (24) tokens on average. ``rollout.max_response_length`` is sized so that the budget never
cuts a trajectory (``trajectories_truncated`` is reported and should be 0).

What is measured (each figure the median of ``--repeats`` calls after the warm-up, the three kinds of call
alternating so that a drift in the machine's load falls on all alike; every call draws the same samples, as
sampling is keyed by the data position, sample and turn, never by the schedule):

- ``kept_cache_tokens_per_s``: the model's tokens (the batch's ``response_mask``) a second of
  ``collect_rollouts(problems, positions, 1.0, n=2, step=0)`` with ``rollout.turn_cache=keep`` (a conversation's
  cache stays in its slot while its tool runs; its next turn prefills only the new tokens onto it), no tool
  latency.
- ``reprefill_tokens_per_s``: the same with every later turn prefilling the whole conversation again;
  ``speedup`` = kept / re-prefill (goal 2x). ``same_tokens``: both gave the same trajectories.
- ``latency_throughput_ratio``: kept-cache tokens a second with ``--latency`` (0.1 s) a tool call over the
  figure without (goal 0.8); ``same_tokens_latency``: the same trajectories. Turns are asynchronous (the other
  conversations decode while a tool runs), but a conversation's own three tool calls come one after another:
  ``latency_floor_seconds`` (3 x the latency) is the least the latency can add to a call,
  ``latency_added_seconds`` what it measurably added.
- ``prefill_tokens_per_model_token`` (re-prefill) and ``kept_prefill_tokens_per_model_token``: prompt tokens
  the engines prefilled over all turns (the agent's ``turn_prefill_tokens``) over the model's tokens;
  ``turns_evicted``: parked conversations whose slot a waiting one took (none at the defaults: every
  conversation has a slot), ``turns_restored``: of them, put back from a host copy of their cache.
- ``engine_seconds_kept`` / ``_latency`` / ``_reprefill``: the engines' wall seconds of a call (medians, summed
  over the engines, which run in parallel) spent decoding (``decode``: the steps and the hand-over of finished
  turns), prefilling and inserting (``prefill``), and waiting with nothing to decode (``wait``). Only
  ``prefill`` differs in kind between the kept cache and re-prefilling, so (decode + prefill) of re-prefill over
  decode alone bounds what keeping the cache can gain here.
- ``speedup_bound``: (decode + prefill) of re-prefill over decode of the kept cache (engine seconds above, same
  run): the speedup keeping the cache would reach if its prefills and hand-overs took no time at all; when it is
  below the 2x goal, decode steps (which both paths run alike) are what keeps the goal out of reach.
- ``turn_programs``: the ``prefill_slots`` programs an engine's later turns can run (``JaxEngine.turn_shapes``
  for its conversations, summed over the engines), compiled before the first call by ``Generator.warm_turns``
  in ``warm_turns_seconds``; ``prefill_slots_traces``: those compiled by the end of the run (the same number:
  no turn met a shape outside the set).
- ``--slots N``: each engine's decode slots (``rollout.max_concurrent_decodes``, default 32), which fixes its KV
  memory (``kv_cache_bytes``: slots x (prompt + response) positions); with fewer slots than conversations, a
  conversation whose answer comes while every slot is taken takes a parked one's slot, whose cache is copied to
  host memory and put back when its own answer comes (``turns_evicted``, ``turns_restored``, of the kept-cache
  calls). Compare ``kept_cache_tokens_per_s`` and ``cpu_seconds_kept`` with a default run for the cost of evicting.
- ``turns_mean``, ``env_tokens_mean``, ``response_tokens_mean``, ``trajectories_truncated``: the agent's metrics
  of the first call (every call is the same).
- ``first_call_seconds``, ``warmup_seconds`` and ``engine_traces``: the first call; the warm-up (the first call of
  each kind, then rounds of a call of each kind until two rounds in a row compile nothing, at most
  ``--warmup-rounds``: turns end at other moments each call, so prefills meet new shape buckets); the programs
  compiled by then.
  ``traces_while_measuring``: programs compiled during the measured calls (should be 0), by program in
  ``traces_while_measuring_by_program`` (``prefill`` / ``insert_many``: the re-prefill path's and the first turns'
  shapes, which no warm-up enumerates; ``prefill_slots`` never, after ``warm_turns``).
- ``cpu_seconds_kept`` / ``_latency`` / ``_reprefill``: the process's CPU seconds of a call (all threads,
  medians) and ``speedup_cpu`` = re-prefill / kept: the work each path does, which a machine shared with other
  jobs (whose load stretches wall times) changes less than the seconds above.
- the machine's limits in the same run: float32 matmul FLOP/s and copy bandwidth (tools/machine_limits.py).

Prints one JSON object on its last line.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # machine_limits, and task.env=bench_multiturn:...
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):  # the job's 8 CPU devices
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import collections  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import zlib  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from machine_limits import copy_bytes_per_s, matmul_flops_per_s  # noqa: E402

from nereus_jax.config import load_config  # noqa: E402
from nereus_jax.models import init_params  # noqa: E402
from nereus_jax.rl.env import EnvStep  # noqa: E402
from nereus_jax.rl.tasks import make_task  # noqa: E402
from nereus_jax.rl.tokenizer import CharTokenizer  # noqa: E402
from nereus_jax.runtime.step.job import Job  # noqa: E402

GOAL_SPEEDUP, GOAL_LATENCY_THROUGHPUT_RATIO = 2.0, 0.8
TOOL_TOKENS = (32, 128)  # a tool message's digits, inclusive
TOOL_TURNS = 3  # assistant turns answered by a tool; the next one is ended by the environment
TEMPLATE_TOKENS = len("[result: ]")  # the plain format's rendering around a tool's output (rl.tools.result_text)


def tool_length(text: str, turn: int) -> int:
    """K digits of the tool message answering assistant turn ``turn`` (1-based) of a row whose problem is
    ``text``: seeded by both, in [32, 128]."""
    rng = np.random.default_rng(zlib.crc32(f"{turn}:{text}".encode()))
    return int(rng.integers(TOOL_TOKENS[0], TOOL_TOKENS[1] + 1))


class FixedToolEnv:
    """Answers each of the first three assistant turns with a tool message of K digits (:func:`tool_length`),
    then ends the trajectory at the fourth; a tool call sleeps ``latency`` seconds. Offers no tools (only eos
    ends a turn)."""

    latency = 0.0

    def __init__(self, task_cfg, tools, fmt):
        self.fmt = fmt

    def reset(self, problem):
        return [{"role": "user", "content": problem.prompt}]

    def step(self, messages, assistant):
        turn = sum(m["role"] == "assistant" for m in messages) + 1
        if turn > TOOL_TURNS:
            return EnvStep([], done=True)
        start = time.perf_counter()
        if self.latency > 0:
            time.sleep(self.latency)
        text = str(messages[0]["content"])
        k = tool_length(text, turn)
        digits = np.random.default_rng(zlib.crc32(f"digits:{turn}:{text}".encode())).integers(0, 10, k)
        return EnvStep([{"role": "tool", "content": "".join(map(str, digits))}], tool_calls=1,
                       tool_seconds=time.perf_counter() - start)


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=8, help="trainer.prompts_per_step")
    p.add_argument("--samples", type=int, default=2, help="n samples a prompt")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--latency", type=float, default=0.1, help="seconds a tool call sleeps (second measurement)")
    p.add_argument("--turn-tokens", type=float, default=24.0, help="mean model tokens a turn (sets --eos-logit)")
    p.add_argument("--eos-logit", type=float, default=None, help="eos logit added to the random policy's "
                   "(default: log((vocab - 1) / (turn_tokens - 1)), about 1 / turn_tokens per token)")
    p.add_argument("--dp", type=int, default=2, help="actor-gen replicas (engines), the tests' 2")
    p.add_argument("--warmup-rounds", type=int, default=20, help="warm-up rounds (a call of each kind) at most, "
                   "until two in a row compile nothing")
    p.add_argument("--slots", type=int, default=None, help="decode slots an engine (rollout.max_concurrent_decodes; "
                   "fewer than its conversations forces evictions)")
    p.add_argument("--quick", action="store_true", help="4 prompts, 1 repeat, one engine (half the compiles)")
    args = p.parse_args()
    if args.quick:
        args.prompts, args.repeats, args.dp = 4, 1, 1
    return args


def response_length(turn_tokens: float) -> int:
    """``rollout.max_response_length``: the tool messages at their longest, and room for the model's turns far
    past their mean (a turn's length is about geometric), rounded up to 64."""
    own = 4 * turn_tokens * 4
    tools = TOOL_TURNS * (TOOL_TOKENS[1] + TEMPLATE_TOKENS + 1)
    return int(-(-(own + tools) // 64) * 64)


def overrides(args: argparse.Namespace) -> list[str]:
    return ["task.env=bench_multiturn:FixedToolEnv", f"rollout.max_turns={TOOL_TURNS + 1}",
            f"rollout.max_response_length={response_length(args.turn_tokens)}", "rollout.max_prompt_length=12",
            f"trainer.prompts_per_step={args.prompts}", f"rollout.samples_per_prompt={args.samples}",
            "logging.progress=false", f"plan.stages.actor-gen.dp={args.dp}"] + \
        ([] if args.slots is None else [f"rollout.max_concurrent_decodes={args.slots}"])


def eos_policy(cfg, tok, prompts: list[list[int]], logit: float) -> dict:
    """Random parameters (``init_params`` at ``trainer.seed``) whose eos logit is about ``logit`` above the
    others (which are all near 0): embedding dimension 0 is a constant in every token, which the residual stream
    carries through the small random layers, and the eos column of the head reads it, scaled by the mean of the
    normed dimension 0 over ``prompts`` (one forward)."""
    from nereus_jax.models.decoder import forward

    params = jax.tree.map(np.array, init_params(cfg.model, seed=cfg.trainer.seed))
    emb, head = params["embed"]["embedding"], params["lm_head"]["kernel"]
    emb[:, 0] = 4.0 * float(np.abs(emb).max())
    head[0, :] = 0.0
    width = max(len(p) for p in prompts)
    tokens = np.asarray([[tok.pad_id] * (width - len(p)) + p for p in prompts], np.int32)
    mask = (tokens != tok.pad_id).astype(np.int32)
    hidden = np.asarray(forward(params, cfg.model, tokens, attention_mask_bt=mask, return_hidden=True))
    head[0, tok.eos_id] = logit / float(np.mean(hidden[..., 0][mask > 0]))
    return params


def prefill_tokens(batch, n: int) -> int:
    """Real tokens the engine prefills over all turns of ``batch`` (see the module docstring)."""
    prompt_len = batch.prompt_mask_bp.sum(1)
    own, ctx = batch.response_mask_br, batch.context_mask_br
    total = int(prompt_len[::n].sum())  # turn 1: one prefill a prompt, shared by its n samples
    for row in range(own.shape[0]):
        m = int(ctx[row].sum())
        o = own[row, :m]
        starts = np.flatnonzero((o[1:] > 0) & (o[:-1] == 0)) + 1  # a model run after an environment's tokens
        total += int((prompt_len[row] + starts).sum())
    return total


def run(args: argparse.Namespace) -> dict:
    cfg = load_config(None, overrides(args))
    tok = CharTokenizer()
    task = make_task(cfg.task)
    positions = np.arange(args.prompts, dtype=np.int64)
    problems = [task.problem(int(p)) for p in positions]
    vocab = cfg.model.vocab_size
    logit = args.eos_logit if args.eos_logit is not None else float(np.log((vocab - 1) / max(args.turn_tokens - 1, 1)))
    params = eos_policy(cfg, tok, [tok.encode_prompt(p.prompt) for p in problems], logit)
    job = Job(cfg, task, tok, actor=params)
    try:
        agent = job.rollout.agent
        env = agent.env
        n = args.samples

        keeps = agent.keeps_cache

        def collect(keep=True):
            agent.keeps_cache = keeps if keep else (lambda: False)
            try:
                return job.collect_rollouts(problems, positions, 1.0, n=n, step=0)
            finally:
                agent.keeps_cache = keeps

        def traces() -> collections.Counter:
            out = collections.Counter()
            for gen in job.rollout.engines:
                out.update(gen.engine.traces)
            return out

        kinds = ((0.0, True), (args.latency, True), (0.0, False))  # (tool latency, kept cache)

        cpu_s: dict = collections.defaultdict(list)

        def timed(latency: float, keep: bool):
            env.latency = latency
            t, cpu = time.perf_counter(), time.process_time()
            try:
                return collect(keep), time.perf_counter() - t
            finally:
                env.latency = 0.0
                cpu_s[(latency, keep)].append(time.process_time() - cpu)

        t = time.perf_counter()
        gens = [g for g in job.rollout.engines if g is not None]
        rows_per_engine = -(-args.prompts // len(gens)) * n
        for gen in gens:  # every later turn's prefill program, up front (the agent would at its first call)
            gen.warm_turns(max_rows=rows_per_engine)
        warm_turns_s = time.perf_counter() - t
        turn_programs = sum(len(g.engine.turn_shapes(max_rows=rows_per_engine)) for g in gens)
        batch, first_s = timed(0.0, True)  # compiles most other programs
        metrics = dict(agent.metrics)
        model_tokens = int(batch.response_mask_br.sum())
        full, _ = timed(0.0, False)  # and the re-prefilling path's
        full_prefilled = agent.metrics["turn_prefill_tokens"]
        assert full_prefilled == prefill_tokens(full, n), "the agent's prefill count disagrees with the batch's"
        same = bool(np.array_equal(full.response_br, batch.response_br))
        slow_batch, _ = timed(args.latency, True)
        same_latency = bool(np.array_equal(slow_batch.response_br, batch.response_br))
        clean = 0
        for _ in range(args.warmup_rounds):  # turns end at other moments each call: new shapes compile now
            before = sum(traces().values())
            for kind in kinds:
                timed(*kind)
            clean = clean + 1 if sum(traces().values()) == before else 0
            if clean == 2:
                break
        warmup_s = time.perf_counter() - t
        warm_traces = traces()

        cpu_s.clear()
        times = {kind: [] for kind in kinds}
        phases = {kind: collections.defaultdict(list) for kind in kinds}
        for _ in range(args.repeats):  # alternating: a drift in the machine's load falls on all alike
            for kind in kinds:
                times[kind].append(timed(*kind)[1])
                for phase, seconds in agent.engine_seconds.items():
                    phases[kind][phase].append(seconds)
                if kind[0]:
                    latency_metrics = dict(agent.metrics)
        phase_medians = [{k: statistics.median(v) for k, v in phases[kind].items()} for kind in kinds]
        cpu_kept, cpu_latency, cpu_full = (statistics.median(cpu_s[kind]) for kind in kinds)
        threads = getattr(agent._pool, "_max_workers", 8)
        plain, slow, again = (times[kind] for kind in kinds)
        seconds, seconds_latency = statistics.median(plain), statistics.median(slow)
        seconds_full = statistics.median(again)
        measured_traces = sum(traces().values()) - sum(warm_traces.values())
        measured_prefill_slots = traces()["prefill_slots"] - warm_traces["prefill_slots"]
        measured_by_program = dict(traces() - warm_traces)
    finally:
        job.close()
    flops, copy = matmul_flops_per_s(), copy_bytes_per_s()
    kept_s, full_s = phase_medians[0], phase_medians[2]
    tps, tps_latency, tps_full = model_tokens / seconds, model_tokens / seconds_latency, model_tokens / seconds_full
    rows = len(problems) * n
    device = jax.devices()[0]
    return {
        "model": cfg.model.name, "prompts": len(problems), "samples": n, "rows": rows, "repeats": args.repeats,
        "max_turns": cfg.rollout.max_turns, "max_prompt_length": cfg.rollout.max_prompt_length,
        "max_response_length": cfg.rollout.max_response_length, "dp": args.dp, "eos_logit": logit,
        "tool_tokens_range": list(TOOL_TOKENS), "tool_latency_s": args.latency,
        "model_tokens": model_tokens, "prefill_tokens": full_prefilled,
        "prefill_tokens_per_model_token": full_prefilled / model_tokens,
        "kept_prefill_tokens": metrics["turn_prefill_tokens"],
        "kept_prefill_tokens_per_model_token": metrics["turn_prefill_tokens"] / model_tokens, "same_tokens": same,
        "same_tokens_latency": same_latency, "engine_seconds_kept": phase_medians[0],
        "engine_seconds_latency": phase_medians[1], "engine_seconds_reprefill": phase_medians[2],
        "engine_traces": dict(warm_traces),
        "traces_while_measuring": measured_traces,
        "traces_while_measuring_by_program": measured_by_program,
        "collect_seconds": seconds, "collect_seconds_latency": seconds_latency,
        "latency_added_seconds": seconds_latency - seconds,
        "latency_floor_seconds": TOOL_TURNS * args.latency, "env_threads": threads,
        "collect_seconds_all": plain, "collect_seconds_latency_all": slow, "collect_seconds_reprefill_all": again,
        "first_call_seconds": first_s, "warmup_seconds": warmup_s, "turns_evicted": metrics["turns_evicted"],
        "turns_restored": metrics["turns_restored"],
        "kept_cache_tokens_per_s": tps, "reprefill_tokens_per_s": tps_full,
        "speedup_bound": (full_s["decode"] + full_s["prefill"]) / kept_s["decode"],
        "turn_programs": turn_programs, "prefill_slots_traces": warm_traces["prefill_slots"] + measured_prefill_slots,
        "warm_turns_seconds": warm_turns_s, "slots": gens[0].engine.max_concurrent_decodes,
        "kv_cache_bytes": gens[0].engine.kv_cache_bytes,
        "turns_evicted_latency": latency_metrics["turns_evicted"],
        "turns_restored_latency": latency_metrics["turns_restored"],
        "speedup": tps / tps_full, "cpu_seconds_kept": cpu_kept, "cpu_seconds_latency": cpu_latency,
        "cpu_seconds_reprefill": cpu_full, "speedup_cpu": cpu_full / cpu_kept,
        "latency_tokens_per_s": tps_latency, "latency_throughput_ratio": tps_latency / tps,
        "goal_speedup": GOAL_SPEEDUP, "goal_latency_throughput_ratio": GOAL_LATENCY_THROUGHPUT_RATIO,
        "turns_mean": metrics["turns_mean"], "env_tokens_mean": metrics["env_tokens_mean"],
        "response_tokens_mean": metrics["response_tokens_mean"], "tool_calls_mean": metrics["tool_calls_mean"],
        "trajectories_truncated": metrics["trajectories_truncated"],
        "tool_seconds_latency": latency_metrics["tool_seconds"],
        "machine_matmul_flops_per_s": flops, "machine_copy_bytes_per_s": copy,
        "simulated": False, "device": str(device.device_kind), "platform": device.platform,
        "num_devices": jax.device_count(), "cpu_count": os.cpu_count(), "jax": jax.__version__,
    }


def main() -> None:
    print(json.dumps(run(_parse())))


if __name__ == "__main__":
    main()
