"""micro_batch * dp * accum == global_batch on every save, in Python and in the database."""

from __future__ import annotations

import pytest
from django.db import IntegrityError, transaction

from jobs.models import BatchInvariantError, Job


def test_save_refuses_a_broken_batch(make_job):
    job = make_job(dp=2, global_batch=64, micro_batch=4)
    job.accum_steps = 3
    with pytest.raises(BatchInvariantError, match="not the global batch 64"):
        job.save()
    job.refresh_from_db()
    assert job.accum_steps == 8


def test_database_rejects_a_broken_batch_that_bypasses_save(make_job):
    job = make_job(dp=2, global_batch=64, micro_batch=4)
    with pytest.raises(IntegrityError), transaction.atomic():
        Job.objects.filter(pk=job.pk).update(accum_steps=5)


def test_shrink_keeps_global_batch_and_doubles_accumulation(make_job):
    # The seed's example: 64 GPUs at global batch 1024 shrunk to 32 keeps micro-batch, doubles accum.
    job = make_job(tp=8, dp=8, dp_min=1, dp_max=8, global_batch=1024, micro_batch=8)
    assert job.accum_steps == 16
    job.set_dp(4)
    job.save(update_fields=["dp", "accum_steps"])
    job.refresh_from_db()
    assert (job.dp, job.accum_steps, job.global_batch, job.micro_batch) == (4, 32, 1024, 8)


def test_set_dp_refuses_a_dp_that_does_not_split_the_batch(make_job):
    job = make_job(dp=2, dp_min=1, dp_max=8, global_batch=64, micro_batch=4)
    with pytest.raises(BatchInvariantError, match="does not split"):
        job.set_dp(3)
    assert job.dp == 2


def test_set_dp_refuses_a_dp_outside_the_elastic_bounds(make_job):
    job = make_job(dp=2, dp_min=2, dp_max=4)
    with pytest.raises(BatchInvariantError, match="outside"):
        job.set_dp(1)


def test_valid_dps_lists_only_exact_splits(make_job):
    job = make_job(dp=2, dp_min=1, dp_max=8, global_batch=64, micro_batch=4)
    assert job.valid_dps() == [1, 2, 4, 8]
