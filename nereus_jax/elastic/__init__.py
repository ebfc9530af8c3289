"""The Nereus core: Elastic Model Units, execution plans, the transition graph and its executor, and the
planning half (cost model, planner, controller) that decides which plan a job should run.

This package file imports nothing: import each name from the module that defines it. Where each concept lives:

- model-stage (``ModelStage``, ``ACTOR_GEN``, ...): :mod:`nereus_jax.model_stage`, outside this package, since
  every layer names model-stages
- EMU, the Elastic Model Unit (one replica of one model-stage with its arrays): ``emu.py``; what its state is,
  per layout: ``spec.py`` (``StateSpec``), and without JAX ``state_bytes.py`` (``ByteSpec``)
- execution plan (``ExecutionPlan``, ``StagePlan``, ``DEVICE`` / ``HOST``): ``plan.py``
- transition graph (``TransitionGraph``, ``plan_usage``): ``graph.py``; its nodes ``primitives.py``, the
  per-stage Split/Destroy/Extend/Merge recipe ``recipe.py`` (``align_ranks``), how a replica splits
  ``factor.py``, scheduling under memory caps ``schedule.py`` (``Infeasible``), the byte ledger ``ledger.py``
  and its check against the devices ``measured.py``
- executor (``TransitionExecutor``, ``TransitionFailed``): ``executor.py``; the per-step weight sync
  ``weight_sync.py``; a model-stage's first state ``sources.py``
- cost model (``CostModel``, ``StageChoice``): ``costs/``; hardware table ``hardware.py``, one RL step's
  shape ``workload.py``, the job's topology ``topology.py``, a job's prices ``pricing.py``
- planner (``Planner``): ``planner/``
- controller (monitor, re-plan, admit): ``controller.py``

Only ``emu``, ``spec``, ``executor``, ``weight_sync``, ``sources`` and ``measured`` import JAX; plans, the
transition graph's metadata and the planning modules do not (``tests/test_import_graph.py`` checks).
"""
