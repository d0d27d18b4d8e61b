from __future__ import annotations

from fastapi import APIRouter, Depends, Query
from sqlalchemy.orm import Session

from backend import queue
from backend.api.deps import ObjectId, get_session, require_write_token
from backend.schemas import EvalTaskResultIn, EvaluationCreate, EvaluationOut, EvaluationStatusUpdate
from backend.services import evaluations

router = APIRouter(tags=["evaluations"])
write = [Depends(require_write_token)]
Db = Depends(get_session, scope="function")


@router.post("/runs/{run_id}/evaluations", status_code=201, response_model=EvaluationOut, dependencies=write)
def start_evaluation(run_id: ObjectId, body: EvaluationCreate, session: Session = Db):
    """Evaluate the run's final checkpoint with lm-evaluation-harness on the given tasks (a Celery job)."""
    ev = evaluations.create_evaluation(session, run_id, body.tasks, body.limit)
    session.commit()
    queue.enqueue_eval(ev.id)
    return evaluations.evaluation_out(session, ev)


@router.get("/runs/{run_id}/evaluations", response_model=list[EvaluationOut])
def list_evaluations(run_id: ObjectId, session: Session = Db):
    return [evaluations.evaluation_out(session, e) for e in evaluations.list_evaluations(session, run_id)]


@router.get("/evaluations/{evaluation_id}", response_model=EvaluationOut)
def get_evaluation(evaluation_id: ObjectId, session: Session = Db):
    return evaluations.evaluation_out(session, evaluations.get_evaluation(session, evaluation_id))


@router.get("/evaluations/{evaluation_id}/job")
def evaluation_job(evaluation_id: ObjectId, session: Session = Db):
    """What a worker needs to run the job: the checkpoint, the tasks, the run's spec (worker-facing)."""
    ev = evaluations.get_evaluation(session, evaluation_id)
    run = evaluations.get_run(session, ev.run_id)
    return {"evaluation_id": ev.id, "run_id": run.id, "tasks": ev.tasks, "limit": ev.limit, "status": ev.status,
            "checkpoint": evaluations.checkpoint_of(session, run.id), "spec": run.spec}


@router.post("/evaluations/{evaluation_id}/status", response_model=EvaluationOut, dependencies=write)
def update_evaluation_status(evaluation_id: ObjectId, body: EvaluationStatusUpdate, session: Session = Db):
    return evaluations.evaluation_out(session, evaluations.update_status(session, evaluation_id, body))


@router.post("/evaluations/{evaluation_id}/results", status_code=201, dependencies=write)
def store_task_result(evaluation_id: ObjectId, body: EvalTaskResultIn, session: Session = Db):
    row = evaluations.store_result(session, evaluation_id, body)
    return {"evaluation_id": evaluation_id, "task": row.task}


@router.get("/experiments/{experiment_id}/accuracy")
def accuracy(experiment_id: ObjectId, method: str = Query("bootstrap", pattern="^(bootstrap|mcnemar)$"),
             session: Session = Db):
    """Tasks x recipes with stderr, and each recipe's paired difference to BF16 with a 95% interval
    (paired bootstrap over documents, or exact McNemar for 0/1 metrics)."""
    return evaluations.accuracy_table(session, experiment_id, method=method)
