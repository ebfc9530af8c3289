"""The package's import graph, read from the source with ``ast`` (nothing is imported): arrows point down.

- No import cycle among nereus_jax modules.
- ``models/`` and ``engine/`` import nothing from ``runtime/`` or ``elastic/``, and ``models/`` nothing from
  ``sharding/`` (the Hugging Face reader and writer take and return host arrays; callers shard and gather).
- ``runtime/``'s sub-packages are layered: ``platform`` (host and devices) < ``step`` (one RL step) <
  ``durability`` (checkpoints, export, warm start) < ``control`` (the controller in the loop, device loss) <
  the loops (``run.py``, ``async_rl.py``, ``report.py``).
- The planning modules (planner, cost model, controller, hardware and workload tables, topology, pricing, the
  simulator, and the ``plan`` / ``simulate`` command lines) import no JAX, directly or through nereus_jax
  modules, so they run where JAX is not installed and start in a fraction of a second.
- The metadata modules (``model_stage``: what a model-stage is and the stage constants; ``layout``; the
  execution plan ``elastic/plan.py``; the transition graph's metadata) import no JAX either, and
  ``model_stage`` imports no nereus_jax module: everything else may import it. Its names are imported from it,
  not from a module that happens to import them, and defined nowhere else.
- No module imports another module's private (underscore) name; nor do tests and tools, but for the unit tests
  of a private helper listed in ``PRIVATE_TESTED``. A name with a public home is imported from there.

Every import is an arrow, at module level or inside a function (it runs when the function does); relative
imports are resolved. Importing ``a.b.c`` also runs the packages ``a`` and ``a.b``, which the reachability
checks follow. Imports under ``if TYPE_CHECKING:`` never run: they count for the layering rules, not for cycles
or JAX. ``from pkg import Name`` where the package provides ``Name`` lazily (a module ``__getattr__``) would
hide where the arrow goes, so the package's own modules name the defining module instead (checked too).
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "nereus_jax"

JAX = frozenset({"jax", "jaxlib", "flax", "optax", "orbax", "chex"})  # flax, optax, orbax and chex import jax

# (importer, imported): no module under the first may import one under the second, directly or through others.
FORBIDDEN = (
    ("nereus_jax.models", "nereus_jax.runtime"),
    ("nereus_jax.models", "nereus_jax.elastic"),
    ("nereus_jax.models", "nereus_jax.sharding"),
    ("nereus_jax.engine", "nereus_jax.runtime"),
    ("nereus_jax.engine", "nereus_jax.elastic"),
)
# runtime/'s sub-packages, bottom up: the host and devices < one step < what outlives a process < the controller
# in the loop < the loops (run.py, async_rl.py, report.py). Each imports nothing from those above it.
RUNTIME_LAYERS = ("platform", "step", "durability", "control")
RUNTIME_LOOPS = ("nereus_jax.runtime.run", "nereus_jax.runtime.async_rl", "nereus_jax.runtime.report")
RUNTIME_FORBIDDEN = tuple(
    (f"nereus_jax.runtime.{low}", dst)
    for i, low in enumerate(RUNTIME_LAYERS)
    for dst in (*(f"nereus_jax.runtime.{high}" for high in RUNTIME_LAYERS[i + 1:]), *RUNTIME_LOOPS))

# Imported with these modules (and every module of these packages), JAX must not be.
PLANNING = (
    "nereus_jax.elastic.planner",
    "nereus_jax.elastic.costs",
    "nereus_jax.elastic.controller",
    "nereus_jax.elastic.hardware",
    "nereus_jax.elastic.workload",
    "nereus_jax.elastic.topology",  # its docstring promises it
    "nereus_jax.elastic.pricing",  # likewise
    "nereus_jax.elastic.adapter",  # the candidate set the job and the simulator share
    "nereus_jax.sim",
    "nereus_jax.simulate",
    "nereus_jax.plan",
)

# Metadata: importing these loads no JAX. Model-stages, layouts, execution plans, and the transition graph
# built from plans and state sizes (only the executor runs it on arrays).
METADATA = ("nereus_jax.model_stage", "nereus_jax.layout", "nereus_jax.vocab_chunks", "nereus_jax.elastic.plan",
            "nereus_jax.elastic.state_bytes",
            "nereus_jax.elastic.primitives", "nereus_jax.elastic.factor", "nereus_jax.elastic.recipe",
            "nereus_jax.elastic.ledger", "nereus_jax.elastic.schedule", "nereus_jax.elastic.graph")

# The one identity of a model-stage and its constants (nothing defines them twice).
MODEL_STAGE = "nereus_jax.model_stage"
MODEL_STAGE_NAMES = ("ModelStage", "StageError", "STAGE_KINDS", "VALUE_HEAD_MODELS", "ACTOR_GEN",
                     "ACTOR_TRAIN", "REF_INFER", "CRITIC_TRAIN", "REWARD_INFER", "split_stage", "stage_kind",
                     "stage_head", "StageDecl", "JOB_STAGES", "declared", "stage_decl", "stage_names", "job_roles")

# A name the package defines in one module and another module re-exports (or a private module defines and the
# package publishes elsewhere): imported from its public home.
PUBLIC_HOME = {"ConfigError": "nereus_jax.config", **{name: MODEL_STAGE for name in MODEL_STAGE_NAMES}}

# Private helpers a test unit-tests directly: (test file, module, name) -> why.
PRIVATE_TESTED = {
    ("tests/rl/test_rewards.py", "nereus_jax.rl.rewards", "_plain_verdict"):
        "the math-verify verdict parser's edge cases, tested on the helper itself",
    ("tests/models/test_lora_dropout.py", "nereus_jax.runtime.step.stages", "_abstract_micro"):
        "the ahead-of-time train inputs against the placed ones (with the dropout seed), helper against helper",
    ("tests/models/test_lora_dropout.py", "nereus_jax.runtime.step.stages", "_put"):
        "the placed train inputs the ahead-of-time signature must equal, helper against helper",
}


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def ancestors(module: str) -> list[str]:
    """The packages importing ``module`` runs first: ``a.b.c`` -> ``a``, ``a.b``."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


@dataclass(frozen=True)
class Arrow:
    source: str  # the importing module
    target: str  # a module of the package, or the top-level name of an outside one ("jax")
    name: str | None  # ``from target import name`` where ``name`` is not a module of its own
    line: int
    runtime: bool  # False under ``if TYPE_CHECKING:``

    def __str__(self) -> str:
        what = f"{self.target}.{self.name}" if self.name else self.target
        return f"{self.source}:{self.line} imports {what}" + ("" if self.runtime else " (TYPE_CHECKING)")


class ImportGraph:
    """Modules of one package and every import in them, from ``{module: (source, is_package)}``."""

    def __init__(self, package: str, sources: Mapping[str, tuple[str, bool]]):
        self.package = package
        self.modules = set(sources)
        self.packages = {m for m, (_, is_package) in sources.items() if is_package}
        self.trees = {m: ast.parse(src, filename=m) for m, (src, _) in sources.items()}
        self.arrows = {m: list(self._arrows(m)) for m in sorted(self.modules)}

    @classmethod
    def of_directory(cls, root: Path, package: str) -> ImportGraph:
        sources = {}
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            sources[".".join(parts[:-1] if is_package else parts)] = (path.read_text(), is_package)
        return cls(package, sources)

    def ours(self, module: str) -> bool:
        return under(module, self.package)

    def known(self, dotted: str) -> str:
        """The longest prefix of ``dotted`` that is a module of the package."""
        parts = dotted.split(".")
        while parts and ".".join(parts) not in self.modules:
            parts.pop()
        assert parts, f"{dotted} names no module of {self.package}"
        return ".".join(parts)

    def _arrows(self, module: str) -> Iterator[Arrow]:
        for node, runtime in _imports(self.trees[module]):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if self.ours(alias.name):
                        yield Arrow(module, self.known(alias.name), None, node.lineno, runtime)
                    else:
                        yield Arrow(module, alias.name.split(".")[0], None, node.lineno, runtime)
                continue
            base = node.module or ""
            if node.level:  # relative: from the module's package, one package up per extra dot
                package = module if module in self.packages else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            if base == "__future__":
                continue
            if not self.ours(base):
                yield Arrow(module, base.split(".")[0], None, node.lineno, runtime)
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in self.modules:
                    yield Arrow(module, sub, None, node.lineno, runtime)
                else:
                    yield Arrow(module, self.known(base), alias.name, node.lineno, runtime)

    # ---------------------------------------------------------------------------------------------- checks
    def cycles(self) -> list[list[Arrow]]:
        """One cycle (as its arrows) per strongly connected group of modules that import each other at run time."""
        edges: dict[str, dict[str, Arrow]] = {m: {} for m in self.modules}
        for m, arrows in self.arrows.items():
            for a in arrows:
                if a.runtime and a.target in self.modules and a.target != m:
                    edges[m].setdefault(a.target, a)
        found = []
        for group in _strongly_connected(edges):
            if len(group) > 1:
                found.append(_cycle_in(edges, group))
        return found

    def path(self, start: str, hit: Callable[[str], bool], *, type_only: bool = False) -> list[str] | None:
        """The first chain of imports (breadth first, so a shortest one) by which importing ``start`` reaches a
        module ``hit`` accepts, each step named; None if none does. Running a module runs its packages first,
        which counts as a step. ``type_only``: follow TYPE_CHECKING imports too (they never run)."""
        first = [(p, [f"{start} runs its package {p}"]) for p in ancestors(start) if p in self.modules]
        queue = deque([(start, [])] + first)
        seen = {start} | {p for p, _ in first}
        while queue:
            module, chain = queue.popleft()
            for a in self.arrows.get(module, ()):
                if not (a.runtime or type_only):
                    continue
                if hit(a.target):
                    return [*chain, str(a)]
                if a.target not in self.modules:
                    continue
                for nxt, step in [(a.target, str(a))] + [(p, f"{a.target} runs its package {p}")
                                                         for p in ancestors(a.target) if p in self.modules]:
                    if nxt not in seen:
                        seen.add(nxt)
                        queue.append((nxt, [*chain, str(a)] if nxt == a.target else [*chain, str(a), step]))
        return None

    def forbidden(self, rules: Iterable[tuple[str, str]]) -> list[str]:
        """Per rule and importing module, the chain by which it reaches what it must not import."""
        out = []
        for src, dst in rules:
            for m in sorted(x for x in self.modules if under(x, src)):
                chain = self.path(m, lambda t, dst=dst: under(t, dst), type_only=True)
                if chain:
                    out.append(f"{m} reaches {dst}: " + " -> ".join(chain))
        return out

    def reaches_jax(self, start: str) -> list[str] | None:
        return self.path(start, lambda t: t in JAX)

    def private_imports(self) -> list[str]:
        """Imports of another module's underscore name, and of a name away from its public home."""
        out = []
        for m, arrows in self.arrows.items():
            for a in arrows:
                if a.name is None or a.target == m or not self.ours(a.target):
                    continue
                if is_private(a.name):
                    out.append(f"{a}: a private name of another module (make it public where it is defined)")
                home = PUBLIC_HOME.get(a.name)
                if home and a.target != home and m != home:
                    out.append(f"{a}: import it from {home}, its public home")
        return out

    def lazy_imports(self) -> list[str]:
        """``from pkg import Name`` where the package only provides Name through its module ``__getattr__``."""
        lazy = {p: _bound_names(self.trees[p]) for p in self.packages if "__getattr__" in _bound_names(self.trees[p])}
        return [f"{a}: {a.target} provides {a.name} lazily, so the arrow is invisible; import it from the module "
                f"that defines it" for arrows in self.arrows.values() for a in arrows
                if a.name is not None and a.target in lazy and a.name not in lazy[a.target]]


def _imports(tree: ast.AST) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement (inside functions and classes too) and whether it runs (not TYPE_CHECKING)."""

    def walk(node: ast.AST, runtime: bool):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, runtime
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                yield from walk(child, False)
            for child in node.orelse:
                yield from walk(child, runtime)
            return
        for child in ast.iter_child_nodes(node):
            yield from walk(child, runtime)

    yield from walk(tree, True)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _bound_names(tree: ast.Module) -> set[str]:
    """Names a module binds at its top level (definitions, assignments, imports)."""
    names = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def _strongly_connected(edges: Mapping[str, Mapping[str, Arrow]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; groups in a fixed order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    group = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        group.append(w)
                        if w == v:
                            break
                    groups.append(sorted(group))
    return groups


def _cycle_in(edges: Mapping[str, Mapping[str, Arrow]], group: list[str]) -> list[Arrow]:
    """A shortest cycle through the group's first module, as the arrows along it."""
    start, members = group[0], set(group)
    queue, back = deque([start]), {start: None}
    while queue:
        v = queue.popleft()
        for w, arrow in sorted(edges[v].items()):
            if w == start:
                chain = [arrow]
                while back[v] is not None:
                    chain.append(back[v])
                    v = back[v].source
                return chain[::-1]
            if w in members and w not in back:
                back[w] = arrow
                queue.append(w)
    raise AssertionError(f"no cycle through {start} in {group}")


def describe_cycle(cycle: list[Arrow]) -> str:
    return " -> ".join([cycle[0].source] + [f"{a.target} (line {a.line} of {a.source})" for a in cycle])


GRAPH = ImportGraph.of_directory(ROOT, PACKAGE)


# ------------------------------------------------------------------------------------------------------- tests
def test_the_graph_holds_every_module_and_its_imports():
    files = sorted((ROOT / PACKAGE).rglob("*.py"))
    assert len(GRAPH.modules) == len(files)
    missing = [m for m in PLANNING if m not in GRAPH.modules]
    assert not missing, f"planning modules listed in PLANNING that do not exist any more: {missing}"
    job = {a.target for a in GRAPH.arrows["nereus_jax.runtime.step.job"]}
    assert {"nereus_jax.runtime.step.move", "jax"} <= job, "the reader lost runtime.job's imports"


def test_no_import_cycles():
    cycles = GRAPH.cycles()
    assert not cycles, "import cycles (move what both need into a module of its own):\n" + "\n".join(
        describe_cycle(c) for c in cycles)


def test_models_and_engine_import_nothing_from_the_layers_above():
    bad = GRAPH.forbidden(FORBIDDEN)
    assert not bad, "imports against the layering (models < sharding < engine < elastic < runtime):\n" + "\n".join(bad)


def test_runtime_sub_packages_import_nothing_from_the_layers_above():
    assert all(any(under(m, f"nereus_jax.runtime.{p}") for p in RUNTIME_LAYERS) or m in RUNTIME_LOOPS
               or m == "nereus_jax.runtime" for m in GRAPH.modules if under(m, "nereus_jax.runtime")), \
        "a runtime module outside the sub-packages and loops: place it in one (and in RUNTIME_LAYERS' docs)"
    bad = GRAPH.forbidden(RUNTIME_FORBIDDEN)
    assert not bad, ("imports against runtime/'s layering (platform < step < durability < control < the loops):\n"
                     + "\n".join(bad))


def test_planning_modules_import_no_jax():
    starts = sorted(m for m in GRAPH.modules if any(under(m, p) for p in PLANNING))
    bad = {m: chain for m in starts if (chain := GRAPH.reaches_jax(m))}
    assert not bad, "planning modules that import JAX (move what needs arrays out of them):\n" + "\n".join(
        f"{m}: " + " -> ".join(chain) for m, chain in bad.items())


def test_metadata_modules_import_no_jax_and_model_stage_nothing_of_the_package():
    assert all(m in GRAPH.modules for m in METADATA), f"a module of METADATA no longer exists: {METADATA}"
    bad = {m: chain for m in METADATA if (chain := GRAPH.reaches_jax(m))}
    assert not bad, "metadata modules that import JAX:\n" + "\n".join(
        f"{m}: " + " -> ".join(chain) for m, chain in bad.items())
    ours = [str(a) for a in GRAPH.arrows[MODEL_STAGE] if GRAPH.ours(a.target)]
    assert not ours, f"{MODEL_STAGE} is the bottom of the graph; it imports: {ours}"
    # the elastic package file is a map of the package, not a lazy face of it: importing it runs nothing
    elastic = "nereus_jax.elastic"
    assert not GRAPH.arrows[elastic] and "__getattr__" not in _bound_names(GRAPH.trees[elastic])


def test_model_stage_names_are_defined_once():
    """Each name of MODEL_STAGE_NAMES is bound by an assignment, def or class only in the model-stage module."""
    defined = {}
    for m, tree in GRAPH.trees.items():
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef):
                names = {node.name}
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            else:
                continue
            for name in names & set(MODEL_STAGE_NAMES):
                defined.setdefault(name, []).append(m)
    assert {n: ms for n, ms in defined.items() if ms != [MODEL_STAGE]} == {}
    assert set(defined) == set(MODEL_STAGE_NAMES)


def test_no_module_imports_another_modules_private_names():
    bad = GRAPH.private_imports()
    assert not bad, "\n".join(bad)


def test_package_modules_import_lazily_exported_names_from_their_defining_module():
    bad = GRAPH.lazy_imports()
    assert not bad, "\n".join(bad)


def test_tests_and_tools_import_no_private_names():
    bad = []
    for path in sorted([*(ROOT / "tests").rglob("*.py"), *(ROOT / "tools").rglob("*.py")]):
        rel = path.relative_to(ROOT).as_posix()
        for node, _ in _imports(ast.parse(path.read_text(), filename=rel)):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and under(node.module or "", PACKAGE):
                bad += [f"{rel}:{node.lineno} imports {a.name} from {node.module}" for a in node.names
                        if is_private(a.name) and (rel, node.module, a.name) not in PRIVATE_TESTED]
    assert not bad, "private names imported by tests or tools (make them public, or list a unit test of the " \
                    "helper itself in PRIVATE_TESTED):\n" + "\n".join(bad)


def test_the_checks_catch_what_they_look_for():
    """A synthetic package with one of each fault: the checks find each, named, and pass a clean one."""
    sources = {
        "pkg": ("", True),
        "pkg.a": ("from pkg.b import f\n", False),
        "pkg.b": ("def f():\n    from pkg import c  # inside a function: still an arrow\n", False),
        "pkg.c": ("import jax.numpy\nfrom . import a\n", False),  # relative, resolved to pkg.a
        "pkg.plan": ("from pkg.c import x\n", False),  # JAX through pkg.c
        "pkg.models": ("", True),
        "pkg.models.m": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.runtime.job import J\n",
                         False),
        "pkg.runtime": ("", True),
        "pkg.runtime.job": ("from pkg.models.m import _hidden\nfrom pkg.lazy import Thing\n", False),
        "pkg.lazy": ("def __getattr__(name):\n    raise AttributeError(name)\n", True),
        "pkg.heavy": ("import optax\n", True),
        "pkg.heavy.light": ("y = 1\n", False),
        "pkg.sim": ("from pkg.heavy.light import y\n", False),  # JAX through the package pkg.heavy.light runs
    }
    graph = ImportGraph("pkg", sources)
    cycles = graph.cycles()
    assert [[(a.source, a.target) for a in c] for c in cycles] == [
        [("pkg.a", "pkg.b"), ("pkg.b", "pkg.c"), ("pkg.c", "pkg.a")]]
    assert describe_cycle(cycles[0]) == ("pkg.a -> pkg.b (line 1 of pkg.a) -> pkg.c (line 2 of pkg.b) -> "
                                         "pkg.a (line 2 of pkg.c)")
    assert graph.forbidden([("pkg.models", "pkg.runtime")]) == [
        "pkg.models.m reaches pkg.runtime: pkg.models.m:3 imports pkg.runtime.job.J (TYPE_CHECKING)"]
    assert graph.reaches_jax("pkg.plan") == ["pkg.plan:1 imports pkg.c.x", "pkg.c:1 imports jax"]
    assert graph.reaches_jax("pkg.models.m") is None  # a TYPE_CHECKING import runs nothing
    assert graph.reaches_jax("pkg.sim") == ["pkg.sim:1 imports pkg.heavy.light.y",
                                            "pkg.heavy.light runs its package pkg.heavy", "pkg.heavy:1 imports optax"]
    assert graph.private_imports() == ["pkg.runtime.job:1 imports pkg.models.m._hidden: a private name of another "
                                       "module (make it public where it is defined)"]
    assert len(graph.lazy_imports()) == 1 and "pkg.lazy provides Thing lazily" in graph.lazy_imports()[0]

    clean = ImportGraph("pkg", {"pkg": ("", True), "pkg.a": ("import numpy\n", False),
                                "pkg.b": ("from pkg.a import f\n", False)})
    assert not clean.cycles() and clean.reaches_jax("pkg.b") is None and not clean.private_imports()


UNIT_OWNER = "nereus_jax.runtime.step.stages"  # StageState: the one writer of the stages' units


def outside(owner: str, lines_of) -> dict[str, list[int]]:
    """Runtime modules other than ``owner`` where ``lines_of(tree)`` finds lines: {module: lines}."""
    return {m: lines for m, tree in GRAPH.trees.items()
            if under(m, "nereus_jax.runtime") and m != owner and (lines := lines_of(tree))}


def unit_writes(tree: ast.AST) -> list[int]:
    """Lines that assign, augment or delete ``<anything>.units`` or ``<anything>.units[...]``."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign | ast.Delete):
            targets = node.targets if isinstance(node, ast.Assign | ast.Delete) else [node.target]
            for t in targets:
                base = t.value if isinstance(t, ast.Subscript) else t
                if isinstance(base, ast.Attribute) and base.attr == "units":
                    lines.append(node.lineno)
    return lines


def test_only_the_stage_owner_writes_the_stages_units():
    """No runtime module but runtime/step/stages.py assigns a model-stage's units: moves, training steps and weight
    syncs hand theirs to ``StageState.replace``. (elastic/ has a transition graph's own ``units`` table.)"""
    # the scan itself: it sees the three forms a writer would use, and not a read
    sample = "job.units[ms] = u\nself.stages.units = {}\ndel job.units[ms]\nx = job.units[ms]\n"
    assert unit_writes(ast.parse(sample)) == [1, 2, 3]
    bad = outside(UNIT_OWNER, unit_writes)
    assert not bad, f"modules writing a stage's units outside {UNIT_OWNER} (call StageState.replace): {bad}"
    assert unit_writes(GRAPH.trees[UNIT_OWNER]), "the owner no longer writes units: update UNIT_OWNER"


def test_only_rollout_gives_engines_parameters():
    """Engines get parameters when Rollout builds them and in ``Rollout.set_params`` (sync and async weight syncs,
    moves): no other runtime module calls a generator's ``set_params`` or an engine's ``adopt_params``."""
    owner = "nereus_jax.runtime.step.rollout"

    def calls(tree: ast.AST) -> list[int]:
        return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                and n.func.attr in ("set_params", "adopt_params") and not (
                    isinstance(n.func.value, ast.Attribute) and n.func.value.attr == "rollout")]

    assert calls(ast.parse("gen.set_params(p)\nself.job.rollout.set_params(3)\ne.adopt_params(x)\n")) == [1, 3]
    bad = outside(owner, calls)
    assert not bad, f"modules giving engines parameters outside {owner} (call Rollout.set_params): {bad}"
    assert calls(GRAPH.trees[owner]), "the owner no longer gives engines parameters: update the owner"


def test_actor_gen_units_change_only_with_the_engines_parameters():
    """A weight sync replaces actor-gen's units and the engines' parameters in one call
    (``Rollout.load_units``): no other runtime module calls ``replace(ACTOR_GEN, ...)``, so no path can leave the
    engines generating from parameters the units no longer hold. (Moves replace every stage's units, then
    ``Rollout.adopt`` gives the engines theirs.)"""
    owner = "nereus_jax.runtime.step.rollout"

    def calls(tree: ast.AST) -> list[int]:
        return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                and n.func.attr == "replace" and n.args and isinstance(n.args[0], ast.Name)
                and n.args[0].id == "ACTOR_GEN"]

    sample = "self.stages.replace(ACTOR_GEN, u)\nstages.replace(ms, u)\nx.replace(ACTOR_GEN)\n"
    assert calls(ast.parse(sample)) == [1, 3]
    bad = outside(owner, calls)
    assert not bad, f"modules replacing actor-gen's units outside {owner} (call Rollout.load_units): {bad}"
    assert calls(GRAPH.trees[owner]), "the owner no longer replaces actor-gen's units: update the owner"


def test_only_the_stage_owner_builds_weight_syncs():
    """``StageState.weight_sync`` is the one place the runtime builds an actor-train -> actor-gen WeightSync (sync
    mode's, a move's check, async mode's double buffer): no other runtime module calls ``WeightSync(...)``, so the
    caps and specs a sync is built with cannot drift between modes."""
    def calls(tree: ast.AST) -> list[int]:
        return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and (
            isinstance(n.func, ast.Name) and n.func.id == "WeightSync"
            or isinstance(n.func, ast.Attribute) and n.func.attr == "WeightSync")]

    assert calls(ast.parse("WeightSync(p)\nx.weight_sync(p)\nws.WeightSync(p)\nWeightSync\n")) == [1, 3]
    bad = outside(UNIT_OWNER, calls)
    assert not bad, f"modules building a WeightSync outside {UNIT_OWNER} (call StageState.weight_sync): {bad}"
    assert calls(GRAPH.trees[UNIT_OWNER]), "the owner no longer builds weight syncs: update the test"


def test_device_loss_recovery_is_one_policy_and_never_replaces_the_job():
    """``runtime/control/recovery.py`` holds the one device-loss policy: no other runtime module checks what survived
    (``surviving_state``), restores a checkpoint onto a plan (``restore_onto``) or builds a ``Recovery``; and no
    runtime module assigns a ``.job`` attribute outside a constructor, so no loop holding a job can be left
    running one that was replaced (a restore after a loss happens inside the same Job)."""
    owner = "nereus_jax.runtime.control.recovery"

    def calls(tree: ast.AST) -> list[int]:
        names = ("surviving_state", "restore_onto", "Recovery")
        return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and (
            isinstance(n.func, ast.Name) and n.func.id in names
            or isinstance(n.func, ast.Attribute) and n.func.attr in names)]

    def job_swaps(tree: ast.AST) -> list[int]:
        lines = []
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) and fn.name != "__init__":
                for node in ast.walk(fn):
                    targets = node.targets if isinstance(node, ast.Assign) else (
                        [node.target] if isinstance(node, ast.AnnAssign | ast.AugAssign) else [])
                    for t in targets:
                        for x in (t.elts if isinstance(t, ast.Tuple) else [t]):
                            if isinstance(x, ast.Attribute) and x.attr == "job":
                                lines.append(node.lineno)
        return sorted(set(lines))

    sample = "surviving_state(j)\nx.restore_onto(j, p)\nRecovery('a')\nrestore_job(c)\n"
    assert calls(ast.parse(sample)) == [1, 2, 3]
    swap = ("class A:\n    def __init__(self, j):\n        self.job = j\n"
            "    def f(self, r):\n        self.job = self.p.job = r\n")
    assert job_swaps(ast.parse(swap)) == [5]
    bad = outside(owner, calls)
    assert not bad, f"device-loss recovery outside {owner} (call recovery.recover): {bad}"
    assert calls(GRAPH.trees[owner]), "the owner no longer recovers: update the test"
    swaps = {m: lines for m, tree in GRAPH.trees.items()
             if under(m, "nereus_jax.runtime") and (lines := job_swaps(tree))}
    assert not swaps, f"runtime modules replacing a .job outside a constructor: {swaps}"
