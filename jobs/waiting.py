"""Why a job waits, in words: the note the job page, the dashboard and their live rows show.

One function per fact, so a reloaded row and a live one (jobs.live_events.job_summary) read the
same, and the text always agrees with the state badge beside it.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.utils import timezone

from jobs.models import ElasticEvent, Job, JobState
from jobs.planner.admission import CANNOT_FIT

NOT_CONSIDERED = "The planner has not considered this job yet."


def cannot_fit(job: Job) -> bool:
    """Whether the planner holds the job because it can never fit the cluster as it is: its ETA
    is then no number at all."""
    return job.is_waiting and job.pending_cause == CANNOT_FIT


def waiting_note(job: Job, last_hold: ElasticEvent | None, now: datetime | None = None) -> dict[str, Any] | None:
    """What the job page and the dashboard say about a waiting job, or None when it does not wait.

    Only pending, preempted and recovering jobs wait (``Job.is_waiting``), so the text always
    agrees with the state badge beside it. ``lead`` and ``tail`` go either side of ``since``
    (when the current reason began, shown as a ``<time>`` in ``style``): "Recovering since
    07:21 after a fault, to restart from step 4200." Then ``reason``, the planner's sentence.
    """
    if not job.is_waiting:
        return None
    since = job.pending_since or job.state_changed_at
    step = job.last_checkpoint_step
    lead, tail = {
        JobState.PENDING: ("Waiting since", ""),
        JobState.PREEMPTED: ("Preempted; waiting since", f" to resume from step {step}"),
        JobState.RECOVERING: ("Recovering since", f" after a fault, to restart from step {step}"),
    }[job.state]
    recent = (now or timezone.now()) - since < timedelta(hours=20)
    return {"lead": lead, "since": since, "tail": tail, "style": "time" if recent else "datetime",
            "reason": pending_reason(job, last_hold) or NOT_CONSIDERED,
            "cannot_fit": cannot_fit(job)}


def pending_reason(job: Job, last_hold: ElasticEvent | None) -> str:
    """Why the job waits, in the planner's words: its latest note, else its last hold row."""
    if job.pending_reason:
        return job.pending_reason
    if last_hold is not None and last_hold.reason_text:
        return last_hold.reason_text
    return NOT_CONSIDERED if job.state == JobState.PENDING else ""
