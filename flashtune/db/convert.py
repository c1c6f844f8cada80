"""ORM rows -> frozen records (:mod:`flashtune.db.records`), called inside a transaction."""

from __future__ import annotations

import json

from flashtune.db.jsonutil import loads_object
from flashtune.db.models import BestConfig, Choice, Device, Problem, Run, Template, Trial
from flashtune.db.records import (
    BestConfigRecord,
    ChoiceRecord,
    DeviceRecord,
    ProblemRecord,
    RunRecord,
    RunStatus,
    SoftwareVersions,
    TemplateRecord,
    TrialRecord,
    TrialState,
)


def device(row: Device) -> DeviceRecord:
    return DeviceRecord(id=row.id, name=row.name, compute_capability=row.compute_capability,
                        sm_count=row.sm_count, shared_mem_per_block=row.shared_mem_per_block,
                        total_memory=row.total_memory)


def template(row: Template) -> TemplateRecord:
    return TemplateRecord(id=row.id, name=row.name, source_hash=row.source_hash)


def problem(row: Problem) -> ProblemRecord:
    return ProblemRecord(id=row.id, template_name=row.template_name,
                         key=loads_object(row.key_json), key_json=row.key_json,
                         bucket=row.bucket)


def run(row: Run) -> RunRecord:
    return RunRecord(
        id=row.id, device_id=row.device_id, template_id=row.template_id,
        problem_id=row.problem_id, study_name=row.study_name, sampler=row.sampler,
        seed=row.seed, params=loads_object(row.params_json), status=RunStatus(row.status),
        started_at=row.started_at, finished_at=row.finished_at,
        flashtune_version=row.flashtune_version, torch_version=row.torch_version,
        triton_version=row.triton_version, cuda_version=row.cuda_version,
        driver_version=row.driver_version or "", host=row.host or "", pid=row.pid)


def trial(row: Trial) -> TrialRecord:
    return TrialRecord(
        id=row.id, run_id=row.run_id, device_id=row.device_id, template_id=row.template_id,
        problem_id=row.problem_id, number=row.number, config=loads_object(row.config_json),
        config_hash=row.config_hash, state=TrialState(row.state), message=row.message,
        median_ms=row.median_ms, p20_ms=row.p20_ms, p80_ms=row.p80_ms, tflops=row.tflops,
        compile_s=row.compile_s, started_at=row.started_at, finished_at=row.finished_at)


def software(row: BestConfig | Choice | Run) -> SoftwareVersions:
    """The versions a best config was tuned under (a choice timed under), or those a run
    recorded."""
    return SoftwareVersions(cuda=row.cuda_version or "", driver=row.driver_version or "",
                            flashtune=row.flashtune_version or "",
                            torch=row.torch_version or "", triton=row.triton_version or "")


def best(row: BestConfig, dev: Device, tpl: Template, prob: Problem) -> BestConfigRecord:
    return BestConfigRecord(
        id=row.id, device=device(dev), template=template(tpl), problem=problem(prob),
        config=loads_object(row.config_json), median_ms=row.median_ms, tflops=row.tflops,
        trial_id=row.trial_id, trials_count=row.trials_count, tuned_at=row.tuned_at,
        software=software(row))


def choice(row: Choice, dev: Device) -> ChoiceRecord:
    candidates = json.loads(row.candidates_json or "[]")
    return ChoiceRecord(
        id=row.id, device=device(dev), op=row.op, problem_key=loads_object(row.key_json),
        bucket=row.bucket, implementation=row.implementation, source_hash=row.source_hash,
        config=loads_object(row.config_json), median_ms=row.median_ms, tflops=row.tflops,
        runner_up=row.runner_up, runner_up_ms=row.runner_up_ms, extern=row.extern,
        extern_ms=row.extern_ms, candidates=tuple(dict(c) for c in candidates),
        decided_at=row.decided_at, software=software(row))
