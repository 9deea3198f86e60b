"""A plan asked again: its decisions on another profile, module timings, number of GPUs or micro-batch
(``estimate --profile/--timings/--gpus/--micro-batch``), and the plan file that records the answer.

[Note: A plan file never contradicts itself]
Every section of a plan file describes the same question: ``cluster`` (GPUs, profile, timings) and
``training`` are what ``predicted`` was computed for, and ``solver``, ``frontier``, ``baselines``,
``layouts`` and ``measurements`` are the search (and ``tune``'s runs) that answered that question. A plan
asked again (:func:`asked_again`) records what it was asked in ``cluster`` and ``training``; written with
its new prediction (:func:`with_prediction`), the sections that answered the old question go, and the
solver says the decisions were given, found by the search for the old question.
"""

from __future__ import annotations

from dataclasses import replace

from shard_planner.plan import Plan, Prediction, SolverInfo


def asked_again(plan: Plan, *, profile: str | None = None, timings: str | None = None, gpus: int | None = None,
                micro_batch: int | None = None) -> Plan:
    """``plan``'s decisions asked on ``profile`` priced by ``timings`` (a path; "" prices compute from FLOPs;
    None keeps the plan's), ``gpus`` (plain FSDP over them, :meth:`Plan.with_world_size`) and ``micro_batch``
    (None: the plan's); its prediction is dropped when anything changed."""
    asked = plan.with_world_size(gpus) if gpus is not None and gpus != plan.cluster.gpus else plan
    if micro_batch is not None and micro_batch != plan.training.micro_batch:
        asked = replace(asked, training=replace(asked.training, micro_batch=micro_batch))
    c = asked.cluster
    asked = replace(asked, cluster=replace(c, profile=profile or c.profile,
                                           timings=c.timings if timings is None else timings or None))
    return asked if _same_question(asked, plan) else replace(asked, predicted=None)


def with_prediction(found: Plan, asked: Plan, prediction: Prediction) -> Plan:
    """``asked`` (:func:`asked_again` of ``found``, the plan as its search answered it) with ``prediction``; when
    the question changed, without the sections that answered the old one ([Note: A plan file never contradicts
    itself])."""
    answered = replace(asked, predicted=prediction)
    if _same_question(asked, found):
        return answered
    how = found.solver.method if found.solver is not None else "given"
    old = found.cluster
    return replace(answered, frontier=(), baselines=(), layouts=(), measurements=(), solver=SolverInfo(
        method="given",
        status=(f"estimated on {asked.cluster.profile} for {asked.cluster.gpus} GPUs, micro-batch "
                f"{asked.training.micro_batch}; the decisions were found by {how} on {old.profile} for {old.gpus} "
                f"GPUs, micro-batch {found.training.micro_batch}"),
        objective=prediction.step_time_s, seconds=0.0))


def _same_question(a: Plan, b: Plan) -> bool:
    """Whether two plans with the same decisions were asked the same: cluster, mesh and training equal."""
    return a.cluster == b.cluster and a.mesh == b.mesh and a.training == b.training
