from __future__ import annotations

from fastapi import APIRouter, Query, Request

from backend.api.deps import WRITE, Holder, ObjectId, SessionDep
from backend.schemas import EvalTaskResultIn, EvaluationCreate, EvaluationOut, EvaluationStatusUpdate
from backend.services import dispatch, evaluations

router = APIRouter(tags=["evaluations"])


@router.post("/runs/{run_id}/evaluations", status_code=201, response_model=EvaluationOut, dependencies=WRITE)
def start_evaluation(run_id: ObjectId, body: EvaluationCreate, session: SessionDep):
    """Evaluate the run's final checkpoint with lm-evaluation-harness on the given tasks (a Celery job)."""
    return evaluations.evaluation_out(session, dispatch.start_evaluation(session, run_id, body))


@router.get("/runs/{run_id}/evaluations", response_model=list[EvaluationOut])
def list_evaluations(run_id: ObjectId, session: SessionDep):
    return [evaluations.evaluation_out(session, e) for e in evaluations.list_evaluations(session, run_id)]


@router.get("/evaluations/{evaluation_id}", response_model=EvaluationOut)
def get_evaluation(evaluation_id: ObjectId, session: SessionDep):
    return evaluations.evaluation_out(session, evaluations.get_evaluation(session, evaluation_id))


@router.get("/evaluations/{evaluation_id}/job")
def evaluation_job(evaluation_id: ObjectId, session: SessionDep):
    """What a worker needs to run the job: the checkpoint, the tasks, the run's spec (worker-facing)."""
    return evaluations.job_of(session, evaluation_id)


@router.post("/evaluations/{evaluation_id}/status", response_model=EvaluationOut, dependencies=WRITE)
def update_evaluation_status(evaluation_id: ObjectId, body: EvaluationStatusUpdate, session: SessionDep,
                             request: Request):
    """A worker's report. `running` starts (claims) the evaluation: 409 while another job holds it (fresh
    heartbeat)."""
    stale_s = request.app.state.settings.stale_s
    return evaluations.evaluation_out(session, evaluations.update_status(session, evaluation_id, body, stale_s))


@router.post("/evaluations/{evaluation_id}/heartbeat", response_model=EvaluationOut, dependencies=WRITE)
def evaluation_heartbeat(evaluation_id: ObjectId, session: SessionDep, holder: Holder = None):
    """A running evaluation's job renews its lease (worker-facing): the API's reconciler sends an evaluation whose
    heartbeats stop for PLAB_STALE_S (its worker died) again, and fails it after PLAB_MAX_ATTEMPTS starts."""
    return evaluations.evaluation_out(session, evaluations.heartbeat(session, evaluation_id, holder))


@router.post("/evaluations/{evaluation_id}/results", status_code=201, dependencies=WRITE)
def store_task_result(evaluation_id: ObjectId, body: EvalTaskResultIn, session: SessionDep):
    """One task's result, while the evaluation is queued or running (a task posted again replaces its result): 409
    once the evaluation has ended, and for a group whose subtasks would lead back to it; 422 for a result whose
    fields disagree (samples without one value per doc_id, a task without per-document values for a metric it
    aggregates, a group listing itself)."""
    row = evaluations.post_result(session, evaluation_id, body)
    return {"evaluation_id": evaluation_id, "task": row.task}


@router.get("/experiments/{experiment_id}/accuracy")
def accuracy(experiment_id: ObjectId, session: SessionDep,
             method: str = Query("bootstrap", pattern="^(bootstrap|mcnemar)$")):
    """Tasks x recipes with stderr, and each recipe's paired difference to BF16 with a 95% interval
    (paired bootstrap over documents, or exact McNemar for 0/1 metrics), its uncorrected p and Holm-corrected
    significance over the run's tasks. 409 with the reason when a run and BF16 scored different documents
    (task hashes or document counts differ)."""
    return evaluations.accuracy_table(session, experiment_id, method=method)
