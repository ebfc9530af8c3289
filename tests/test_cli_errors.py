"""Every bad input to a command-line entry point fails the same way: exit status 2, exactly one line on stderr
that names the flag, key or file to change, no traceback, nothing on stdout and nothing written.

One table, one row per bad input, for ``plan``, ``simulate``, ``train`` and ``export``: ``bad(name, cli, argv,
*expected substrings, files={path: text | bytes | None (a folder) | Build})``. Each row runs in an empty working
directory holding only its ``files`` (a :class:`Build` makes a Hugging Face checkpoint, a Parquet file or a
saved run's checkpoint there: built once per module, then copied and damaged as the row says); any file or
folder the CLI leaves there (a run directory, a plot, a half-written export) fails the row. Most rows call
``nereus_jax.<cli>.main(argv)`` in this process (a bad input must fail before any heavy work, so they are
fast); rows with ``subprocess=True`` run ``python -m nereus_jax.<cli>`` to prove that nothing escapes the real
entry point as a traceback or log noise.

    python -m pytest tests/test_cli_errors.py -q                 # all rows (the export rows train 1 PPO step once)
    python -m pytest tests/test_cli_errors.py -q -k "train-"     # one CLI's rows
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from nereus_jax.sim import load_trace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "runtime"))  # hf_checkpoints: a tiny checkpoint, tokenizer, prompts
FOLDER = None  # a ``files`` value: make a directory
DROP = object()  # a trace change: remove the key

# A valid, small trace: every simulate row changes one thing of it.
TRACE = {
    "name": "bad_input", "hardware": "a100", "models": "qwen2.5-0.5b", "algorithm": "ppo", "steps": 2, "seed": 0,
    "workload": {"prompts_per_step": 64, "samples_per_prompt": 1, "packed": True,
                 "prompt_length": {"mean": 128, "p95": 256, "max": 512}},
    "response_length": {"max_over_p95": 1.15, "jitter": 0.0, "keyframes": [{"step": 0, "mean": 500, "p95": 600}]},
    "pool": [{"step": 0, "devices": 4}],
    "controller": {"gamma": 0.5},
}


@dataclass(frozen=True)
class Build:
    """A ``files`` value made by code: ``source`` (a key of :class:`Store`: ``hf:qwen3``, ``rm:64``,
    ``run``) copied to the path, then each ``change`` applied to the copy, e.g. ``("drop", "tokenizer.json")``,
    ``("cut", "model.safetensors", 100)`` (keep the first 100 bytes), ``("write", "config.json", text)``,
    ``("json", "tokenizer_config.json", {"chat_template": ...})`` (keys merged in); a name with ``*`` changes
    every file the glob matches. ``parquet`` rows instead write a Parquet file of those rows."""

    source: str = ""
    changes: tuple[tuple, ...] = ()
    parquet: tuple[dict, ...] | None = None

    def make(self, target: Path, store: Store) -> None:
        if self.parquet is not None:
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(list(self.parquet)), target)
            return
        shutil.copytree(store.get(self.source), target)
        for kind, name, *arg in self.changes:
            _change(target, kind, name, *arg)


def _change(folder: Path, kind: str, name: str, *arg) -> None:
    """One change to ``folder/name``; a glob changes every file it matches."""
    for path in sorted(folder.glob(name)) if "*" in name else [folder / name]:
        if kind == "drop":
            path.unlink()
        elif kind == "cut":
            path.write_bytes(path.read_bytes()[: arg[0]])
        elif kind == "write":
            path.write_bytes(arg[0]) if isinstance(arg[0], bytes) else path.write_text(arg[0])
        elif kind == "json":
            path.write_text(json.dumps({**json.loads(path.read_text()), **arg[0]}))
        else:
            raise AssertionError(kind)


@dataclass
class Store:
    """What rows copy, made once per module on first use: tiny Hugging Face checkpoints and a saved run."""

    root: Path
    made: dict[str, Path] = field(default_factory=dict)

    def get(self, key: str) -> Path:
        if key not in self.made:
            kind, _, arg = key.partition(":")
            self.made[key] = getattr(self, f"_{kind}")(self.root / key.replace(":", "-"), arg)
        return self.made[key]

    @staticmethod
    def _hf(folder: Path, family: str) -> Path:
        from hf_checkpoints import write_checkpoint

        return write_checkpoint(folder, family)

    @staticmethod
    def _sharded(folder: Path, family: str) -> Path:
        """The checkpoint in several safetensors files with their index."""
        from hf_checkpoints import model_config, write_tokenizer

        from nereus_jax.models import init_params, save_hf

        cfg = model_config(family)
        save_hf(folder, cfg, init_params(cfg), max_shard_bytes=100_000)
        write_tokenizer(folder)
        return folder

    @staticmethod
    def _rm(folder: Path, vocab: str) -> Path:
        """A *ForSequenceClassification reward model with ``vocab`` tokens."""
        import dataclasses as dc

        from hf_checkpoints import model_config

        from nereus_jax.models import init_params, save_hf

        cfg = dc.replace(model_config("qwen3"), vocab_size=int(vocab))
        return save_hf(folder, cfg, init_params(cfg, head="value"), head="value")

    @staticmethod
    def _run(folder: Path, _: str) -> Path:
        """The checkpoint folder of a real run: 1 tiny PPO step, saved."""
        from nereus_jax.config import load_config
        from nereus_jax.runtime.run import run_job

        overrides = ["trainer.steps=1", "checkpoint.every_steps=1", "trainer.warmup_sft_steps=0",
                     "cluster.num_devices=1", "cluster.schedule=[]", "plan.stages.actor-gen.dp=1",
                     "trainer.prompts_per_step=4", "rollout.samples_per_prompt=2", "rollout.max_prompt_length=8",
                     "rollout.max_response_length=4", "task.num_digits=1", "task.eval_size=4",
                     "controller.enabled=false", "logging.progress=false", "logging.tensorboard=false"]
        run_job(load_config("ppo_tiny", overrides), str(folder / "run"))
        return folder / "run" / "checkpoints"


@dataclass(frozen=True)
class Bad:
    name: str
    cli: str                                           # module under nereus_jax: plan, simulate, ...
    argv: tuple[str, ...]
    expect: tuple[str, ...]                            # each must appear in the one error line
    files: tuple[tuple[str, str | bytes | None | Build], ...]  # created in the working directory first
    subprocess: bool = False


def bad(name: str, cli: str, argv: list[str], *expect: str, files: dict | None = None, subprocess: bool = False):
    row = Bad(name, cli, tuple(argv), expect, tuple((files or {}).items()), subprocess)
    return pytest.param(row, id=f"{cli}-{name}")


def trace_yaml(changes: dict) -> str:
    """TRACE with dotted keys changed (``{"workload.prompts_per_step": 0}``; DROP removes one), as YAML."""
    data = copy.deepcopy(TRACE)
    for dotted, value in changes.items():
        *parents, last = dotted.split(".")
        node = data
        for key in parents:
            node = node[key]
        if value is DROP:
            del node[last]
        else:
            node[last] = value
    return yaml.safe_dump(data)


def calibration_json(**changes) -> str:
    """A run's calibration.json (a100, GEMMs at 0.4 of peak) with ``changes``."""
    return json.dumps({"format": 1, "hardware": "a100", "efficiency": {"gemm": 0.4}, "half_sizes": {}, **changes})


def sim(name: str, changes: dict, *expect: str, subprocess: bool = False):
    """A simulate row over ``trace.yaml`` = TRACE with ``changes``; the error names the file and ``expect``."""
    return bad(name, "simulate", ["trace.yaml"], "trace.yaml", *expect, files={"trace.yaml": trace_yaml(changes)},
               subprocess=subprocess)


LONG = [{"step": 0, "mean": 30000, "p95": 32000}]  # * 1.15 + 512 > qwen2.5-0.5b's 32,768 positions

# ``train`` rows over a local checkpoint: everything valid (test_the_tables_base_train_inputs_are_valid) except
# the one file or key a row changes.
HF_ARGS = ["model.hf_path=ckpt", "task.name=file", "task.prompt_file=p.jsonl", "rollout.max_prompt_length=24",
           "task.eval_size=2"]
PROMPTS = "".join(json.dumps({"prompt": [{"role": "user", "content": f"What is {a} plus 1?"}], "answer": str(a + 1)})
                  + "\n" for a in range(2))
MISTRAL = {"architectures": ["MistralForCausalLM"], "model_type": "mistral"}
SHARD_2 = "model-00002-of-*.safetensors"  # a glob (the shard count depends on the tensors' sizes)
BINARY = b"\x89PNG\r\n\x1a\n\xff\xfe\x00"


def hf(name: str, argv: list[str], *expect: str, subprocess: bool = False, **files):
    """A train row over HF_ARGS (+ ``argv``, later keys win) with a valid checkpoint ``ckpt`` and prompt file
    ``p.jsonl`` unless ``files`` replaces them."""
    files = {"ckpt": Build("hf:qwen3"), "p.jsonl": PROMPTS + PROMPTS, **files}
    return bad(name, "train", HF_ARGS + argv, *expect, files=files, subprocess=subprocess)

ROWS = [
    # ------------------------------------------------------------------ python -m nereus_jax.plan
    bad("samples-per-prompt-0", "plan", ["--samples-per-prompt", "0"], "--samples-per-prompt", subprocess=True),
    bad("samples-per-prompt-1-grpo", "plan", ["--algorithm", "grpo", "--samples-per-prompt", "1"],
        "--samples-per-prompt >= 2"),
    bad("response-beyond-context", "plan", ["--model", "qwen2.5-0.5b", "--response-length", "40000"],
        "--response-length", "max_position_embeddings (32768)"),
    bad("gpus-not-int", "plan", ["--gpus", "abc"], "--gpus", subprocess=True),
    bad("gpus-0", "plan", ["--gpus", "0"], "--gpus"),
    bad("batch-0", "plan", ["--batch", "0"], "--batch"),
    bad("prompt-length-negative", "plan", ["--prompt-length", "-3"], "--prompt-length"),
    bad("unknown-hardware", "plan", ["--hardware", "h300"], "--hardware", "valid: h100"),
    bad("unknown-model", "plan", ["--model", "llama9"], "--model", "llama9"),
    bad("unknown-algorithm", "plan", ["--algorithm", "dpo"], "--algorithm", "dpo"),
    bad("headroom-1", "plan", ["--headroom", "1"], "--headroom"),
    bad("runners-up-negative", "plan", ["--runners-up", "-1"], "--runners-up"),
    bad("unknown-flag", "plan", ["--nodes", "8"], "--nodes"),
    bad("calibration-missing", "plan", ["--calibration", "nope"], "--calibration", "nope"),
    bad("calibration-run-dir-without-it", "plan", ["--calibration", "run"], "--calibration", "run",
        "no calibration.json", files={"run": FOLDER}),
    bad("calibration-malformed-json", "plan", ["--calibration", "run"], "--calibration", "run/calibration.json",
        "not valid JSON", files={"run/calibration.json": '{"format": 1,'}, subprocess=True),
    bad("calibration-format-2", "plan", ["--calibration", "c.json"], "--calibration", "c.json", "format 2",
        files={"c.json": calibration_json(format=2)}),
    bad("calibration-unknown-class", "plan", ["--calibration", "c.json"], "--calibration", "c.json", "tensor_cores",
        files={"c.json": calibration_json(efficiency={"gemm": 0.5, "tensor_cores": 0.9})}),
    bad("calibration-other-hardware", "plan", ["--hardware", "h100", "--calibration", "c.json"], "--hardware h100",
        "c.json", "(a100)", "drop --hardware", files={"c.json": calibration_json()}),
    # ------------------------------------------------------ python -m nereus_jax.simulate: the file
    bad("missing-file", "simulate", ["nope.yaml"], "nope.yaml"),
    bad("directory", "simulate", ["adir"], "adir", files={"adir": FOLDER}),
    bad("malformed-yaml", "simulate", ["t.yaml"], "t.yaml", "line 2", files={"t.yaml": "steps: [1, 2\n"},
        subprocess=True),
    bad("empty-yaml", "simulate", ["t.yaml"], "t.yaml", "mapping", files={"t.yaml": ""}),
    bad("list-yaml", "simulate", ["t.yaml"], "t.yaml", "mapping", files={"t.yaml": "- 1\n- 2\n"}),
    bad("binary-file", "simulate", ["t.yaml"], "t.yaml", files={"t.yaml": b"\x89PNG\r\n\x1a\n\xff\xfe\x00"},
        subprocess=True),
    # -------------------------------------------------------- python -m nereus_jax.simulate: its keys
    sim("steps-not-int", {"steps": "abc"}, "steps"),
    sim("steps-fraction", {"steps": 1.5}, "steps"),
    sim("steps-0", {"steps": 0}, "steps"),
    sim("seed-not-int", {"seed": "abc"}, "seed"),
    sim("no-hardware", {"hardware": DROP}, "hardware"),
    sim("unknown-hardware", {"hardware": "h300"}, "hardware", "valid: h100", subprocess=True),
    sim("unknown-model", {"models": "llama9"}, "models.", "llama9"),
    sim("unknown-role", {"models": {r: "qwen2.5-0.5b" for r in ("actor", "critc", "ref", "reward")}}, "critc"),
    sim("missing-role", {"models": {"actor": "qwen2.5-0.5b"}}, "models", "critic"),
    sim("model-not-a-name", {"models": ["qwen2.5-0.5b"]}, "models"),
    sim("unknown-algorithm", {"algorithm": "dpo"}, "algorithm", "dpo"),
    sim("prompts-0", {"workload.prompts_per_step": 0}, "workload.prompts_per_step"),
    sim("samples-0", {"workload.samples_per_prompt": 0}, "workload.samples_per_prompt"),
    sim("samples-1-grpo", {"algorithm": "grpo"}, "workload.samples_per_prompt"),
    sim("prompt-p95-below-mean", {"workload.prompt_length.p95": 100}, "workload.prompt_length"),
    sim("prompt-max-below-p95", {"workload.prompt_length.max": 200}, "workload.prompt_length"),
    sim("response-p95-below-mean", {"response_length.keyframes": [{"step": 0, "mean": 600, "p95": 500}]},
        "response_length.keyframes[0]"),
    sim("keyframe-without-p95", {"response_length.keyframes": [{"step": 0, "mean": 600}]},
        "response_length.keyframes[0]"),
    sim("response-beyond-context", {"response_length.keyframes": LONG}, "max_position_embeddings (32768)"),
    sim("max-over-p95-below-1", {"response_length.max_over_p95": 0.5}, "response_length.max_over_p95"),
    sim("pool-0", {"pool": [{"step": 0, "devices": 0}]}, "pool[0].devices"),
    sim("pool-row-without-devices", {"pool": [{"step": 0, "devices": 4}, {"step": 1}]}, "pool[1]"),
    sim("unknown-top-key", {"stpes": 3}, "stpes"),
    sim("unknown-section-key", {"controller.gamam": 1}, "gamam"),
    sim("section-not-a-mapping", {"controller": 5}, "controller"),
    sim("gamma-not-a-number", {"controller.gamma": "abc"}, "controller.gamma"),
    sim("headroom-2", {"planner": {"headroom": 2}}, "planner.headroom"),
    sim("slowdown-not-a-pair", {"truth": {"straggler_slowdown": 3}}, "truth.straggler_slowdown"),
    sim("unknown-policy-in-trace", {"policies": ["fixed", "nereus5"]}, "policies", "nereus5"),
    # ------------------------------------------------------- python -m nereus_jax.simulate: its flags
    bad("unknown-policy", "simulate", ["paper_drift", "--policies", "fixed,nerues"], "--policies", "nerues"),
    bad("no-policy", "simulate", ["paper_drift", "--policies", ","], "--policies"),
    bad("set-without-value", "simulate", ["paper_drift", "--set", "steps"], "--set"),
    bad("set-unknown-key", "simulate", ["paper_drift", "--set", "controller.gamam=1"], "controller.gamam"),
    bad("set-bad-yaml", "simulate", ["paper_drift", "--set", "steps=[1"], "--set", "steps=[1"),
    bad("set-bad-value", "simulate", ["paper_drift", "--set", "steps=abc"], "steps"),
    bad("sweep-without-values", "simulate", ["paper_drift", "--sweep", "controller.gamma"], "--sweep"),
    bad("sweep-bad-later-value", "simulate", ["paper_drift", "--sweep", "seed=1,x", "--json"], "seed"),
    bad("seed-not-int", "simulate", ["paper_drift", "--seed", "abc"], "--seed"),
    bad("plot-under-a-file", "simulate", ["paper_drift", "--plot", "f/x.png"], "--plot", files={"f": "x"}),
    # ------------------------------------------- python -m nereus_jax.train: the checkpoint (model.hf_path)
    hf("not-a-checkpoint", [], "model.hf_path='ckpt'", "config.json", ckpt=FOLDER),
    hf("checkpoint-missing", ["model.hf_path=nope"], "model.hf_path='nope'", "not a directory"),
    hf("unsupported-architecture", [], "model_type='mistral'", "Qwen3ForCausalLM",
       ckpt=Build("hf:qwen3", (("json", "config.json", MISTRAL),))),
    hf("missing-shard", [], "model-00002-of-", "is missing", "model.safetensors.index.json",
       ckpt=Build("sharded:qwen3", (("drop", SHARD_2),))),
    hf("truncated-shard", [], "model.safetensors", "truncated",
       ckpt=Build("hf:qwen3", (("cut", "model.safetensors", 20_000),))),
    hf("empty-safetensors", [], "model.safetensors", "empty (0 bytes)",
       ckpt=Build("hf:qwen3", (("cut", "model.safetensors", 0),))),
    hf("contradicting-model-key", ["model.num_layers=3"], "model.num_layers=3", "gives 2"),
    # ------------------------------------------------------------ python -m nereus_jax.train: the tokenizer
    hf("no-tokenizer", [], "model.hf_path='ckpt'", "no tokenizer.json",
       ckpt=Build("hf:qwen3", (("drop", "tokenizer.json"),))),
    hf("tokenizer-json-not-a-tokenizer", [], "tokenizer.json", "is not a Hugging Face tokenizer.json",
       ckpt=Build("hf:qwen3", (("write", "tokenizer.json", '{"hello": 1}'),))),
    hf("tokenizer-path-binary", ["task.tokenizer_path=tok.json"], "task.tokenizer_path='tok.json'",
       "is not a Hugging Face tokenizer.json", **{"tok.json": b"\x89PNG\r\n\x1a\n\xff\xfe\x00"}),
    hf("chat-template-raises", [], "tokenizer_config.json", "failed to render", "no",
       ckpt=Build("hf:qwen3", (("json", "tokenizer_config.json", {"chat_template": "{{ raise_exception('no') }}"}),))),
    hf("chat-template-syntax-error", [], "error: the chat template in ckpt/tokenizer_config.json does not compile",
       ckpt=Build("hf:qwen3", (("json", "tokenizer_config.json", {"chat_template": "{% for m in messages %}"}),))),
    # ---------------------------------------------------------- python -m nereus_jax.train: the prompt file
    hf("jsonl-row-without-answer", [], "p.jsonl:3", "'answer'", "task.answer_key",
       **{"p.jsonl": PROMPTS + '{"prompt": "What is 2 plus 2?"}\n'}),
    hf("parquet-without-answer-column", ["task.prompt_file=p.parquet"], "p.parquet", "'answer'", "task.answer_key",
       **{"p.parquet": Build(parquet=({"prompt": "What is 2 plus 2?", "question": "x"},) * 4)}),
    hf("parquet-row-with-null-answer", ["task.prompt_file=p.parquet"], "p.parquet:row 2", "'answer'",
       **{"p.parquet": Build(parquet=tuple({"prompt": "What is 2 plus 2?", "answer": None if i == 2 else "4"}
                                           for i in range(4)))}),
    hf("binary-prompt-file", [], "p.jsonl:1", "UTF-8", **{"p.jsonl": BINARY}),
    hf("non-utf8-prompt-file", [], "p.jsonl:3", "UTF-8",
       **{"p.jsonl": PROMPTS.encode() + '{"prompt": "caf\u00e9", "answer": "1"}\n'.encode("latin-1")}),
    hf("prompt-file-is-a-directory", [], "'p.jsonl'", "is a directory", **{"p.jsonl": FOLDER}),
    bad("character-outside-the-alphabet", "train", ["task.name=file", "task.prompt_file=p.jsonl", "task.eval_size=1"],
        "'\u00d7'", "p.jsonl:2", "task.tokenizer_path", "model.hf_path",
        files={"p.jsonl": '{"prompt": "2+2=", "answer": "4"}\n{"prompt": "3\u00d74=", "answer": "12"}\n'}),
    # ------------------------------------------------------------------ python -m nereus_jax.train: reward
    bad("reward-fn-does-not-import", "train", ["task.reward=python", "task.reward_fn=no_such_module:score"],
        "task.reward_fn='no_such_module:score'", "does not import"),
    bad("reward-fn-not-callable", "train", ["task.reward=python", "task.reward_fn=math:pi"],
        "task.reward_fn='math:pi'", "not callable"),
    # ------------------------------------------------------------------ python -m nereus_jax.train: agents
    bad("env-does-not-import", "train", ["task.env=no_such_module:Env"], "task.env='no_such_module:Env'",
        "importable"),
    bad("env-unknown-tool", "train", ["task.env=tools", "task.tools=[calculator,search]"], "task.tools=",
        "built-in tools are"),
    bad("tool-format-needs-a-chat-template", "train", ["task.env=calculator", "task.tool_format=hermes"],
        "task.tool_format=hermes", "task.tool_format=plain"),
    hf("reward-model-vocabulary-too-small", ["task.reward_model_path=rm"], "task.reward_model_path='rm'",
       "vocab_size", "64", rm=Build("rm:64")),
    # -------------------------------------------------------- python -m nereus_jax.train: config and plan
    bad("binary-config-file", "train", ["junk.bin"], "junk.bin", files={"junk.bin": BINARY}, subprocess=True),
    bad("schedule-removes-every-device", "train", ["cluster.schedule=[{step: 1, leave: [0,1,2,3,4,5,6,7]}]"],
        "cluster.schedule[0]", "no device"),
    bad("tp-not-dividing-the-model", "train", ["plan.default.tp=3"], "plan.default.tp", "cannot lay out model-stage",
        subprocess=True),
    # ---------------------------------------------------------------------- python -m nereus_jax.export
    bad("checkpoint-missing", "export", ["nope", "out"], "'nope'", "does not exist", subprocess=True),
    bad("checkpoint-not-a-folder", "export", ["f", "out"], "'f'", "not a folder", files={"f": "x"}),
    bad("no-complete-step", "export", ["ckpts", "out"], "ckpts", "no complete",
        files={"ckpts": FOLDER, "ckpts/2.orbax-checkpoint-tmp-1": FOLDER}),
    bad("out-dir-is-a-file", "export", ["ckpts", "out"], "'out'", "OUT_DIR", files={"ckpts": Build("run:"),
                                                                                      "out": "x"}),
    bad("out-dir-under-a-file", "export", ["ckpts", "f/out"], "'f/out'", "is a file",
        files={"ckpts": Build("run:"), "f": "x"}),
    bad("out-dir-holds-the-checkpoint", "export", ["run/ckpts", "run"], "'run'", "holds the checkpoint",
        files={"run/ckpts": Build("run:")}),
    bad("step-folder-without-metadata", "export", ["ckpts", "out"], "ckpts/1", "incomplete or damaged",
        files={"ckpts": Build("run:", (("drop", "1/meta/metadata"),))}),
    bad("damaged-state-data", "export", ["ckpts", "out"], "ckpts/1", "incomplete or damaged",
        files={"ckpts": Build("run:", (("cut", "1/state/**/d/*", 10),))}, subprocess=True),
    bad("damaged-metadata", "export", ["ckpts", "out"], "ckpts/1", "incomplete or damaged",
        files={"ckpts": Build("run:", (("write", "1/meta/metadata", "{not json"),))}),
    bad("metadata-without-entries", "export", ["ckpts", "out"], "ckpts/1", "damaged", "'model'",
        files={"ckpts": Build("run:", (("write", "1/meta/metadata", '{"format": 1}'),))}),
    bad("damaged-state-metadata", "export", ["ckpts", "out"], "ckpts/1", "incomplete or damaged", "JSONDecodeError",
        files={"ckpts": Build("run:", (("write", "1/state/_METADATA", "{not json"),))}),
    bad("damaged-state-manifest", "export", ["ckpts", "out"], "ckpts/1", "incomplete or damaged", "manifest.ocdbt",
        files={"ckpts": Build("run:", (("cut", "1/state/manifest.ocdbt", 5),))}, subprocess=True),
]


def test_the_tables_base_trace_is_valid(tmp_path):
    """So each simulate row fails for the one thing it changes."""
    (tmp_path / "trace.yaml").write_text(trace_yaml({}))
    assert load_trace(tmp_path / "trace.yaml").steps == 2


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Store:
    return Store(tmp_path_factory.mktemp("cli-errors-store"))


def test_the_tables_base_train_inputs_are_valid(store, tmp_path, monkeypatch):
    """So each train row over a checkpoint fails for the one thing it changes."""
    from nereus_jax.config import load_config
    from nereus_jax.runtime.run import check_inputs

    store.get("hf:qwen3")
    _make_files(hf("base", []).values[0], tmp_path, store)
    monkeypatch.chdir(tmp_path)
    inputs = check_inputs(load_config("ppo_tiny", HF_ARGS), log=lambda _: None)
    inputs.rewarder.close()
    assert inputs.actor is not None and inputs.dropped == 0 and inputs.task.num_train == 2


@pytest.mark.parametrize("row", ROWS)
def test_bad_input_exits_2_with_one_line_naming_it_and_writes_nothing(row: Bad, store, tmp_path, monkeypatch,
                                                                      capsys):
    _make_files(row, tmp_path, store)
    capsys.readouterr()  # what building the files printed
    before = sorted(tmp_path.rglob("*"))
    monkeypatch.chdir(tmp_path)
    code, out, err = _subprocess(row, tmp_path) if row.subprocess else _in_process(row, capsys)
    assert "Traceback" not in out + err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert all(s in lines[0] for s in row.expect), (row.expect, lines[0])
    assert code == 2 and out == "", (code, out)
    assert sorted(tmp_path.rglob("*")) == before  # no run directory, plot, export or other output


def _make_files(row: Bad, folder: Path, store: Store) -> None:
    for path, content in row.files:
        target = folder / path
        target.parent.mkdir(parents=True, exist_ok=True)
        if content is FOLDER:
            target.mkdir()
        elif isinstance(content, Build):
            content.make(target, store)
        elif isinstance(content, bytes):
            target.write_bytes(content)
        else:
            target.write_text(content)


def _in_process(row: Bad, capsys) -> tuple[int, str, str]:
    """main(argv) here; an exception other than SystemExit fails the test with its traceback."""
    main = importlib.import_module(f"nereus_jax.{row.cli}").main
    try:
        result = main(list(row.argv))
        code = result if isinstance(result, int) else 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _subprocess(row: Bad, cwd: Path) -> tuple[int, str, str]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))}
    done = subprocess.run([sys.executable, "-m", f"nereus_jax.{row.cli}", *row.argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    return done.returncode, done.stdout, done.stderr
