"""``codegen.sources``: a rank plans and generates only its own module; the others' are generated when read, as before."""

from __future__ import annotations

import pickle
from pathlib import Path


import lightning_nnscaler as lnn
from lightning_nnscaler.materialize.posts import receive_posts
from lightning_nnscaler.materialize.releases import pipeline_releases, rank_releases
from support.rank_plans import gpt_plan


def dp_tp_pp_plan(rank: int | None) -> lnn.Plan:
    """dp 2 × tp 2 × pp 2 (hybrid3d, 2 microbatches)."""
    return gpt_plan("hybrid3d", 8, rank, dp=2, tp=2, pp=2)


def test_a_rank_generates_its_own_module_only_and_every_module_equals_the_eager_plans() -> None:
    eager, local = dp_tp_pp_plan(None), dp_tp_pp_plan(5)
    assert local.sources.generated() == [5] and eager.sources.generated() == list(range(8))
    assert local.plan_hash == eager.plan_hash
    assert local.sources[5] == eager.sources[5]
    assert list(local.sources) == list(eager.sources) and local.sources.generated() == list(range(8))
    assert local.sources[-1] == eager.sources[7] and local.sources[1:3] == [eager.sources[1], eager.sources[2]]


def test_a_plan_made_for_one_rank_verifies_and_explains_every_rank() -> None:
    plan = dp_tp_pp_plan(3)
    report = plan.verify()  # runs every rank's module, generated now
    assert report.world_size == 8 and report.parameters_checked > 0 and plan.sources.generated() == list(range(8))
    assert len(plan.memory_rows()) == 8 and "on 8 ranks" in plan.explain()


def test_the_lazy_sources_pickle_and_save_as_the_list_they_stand_for(tmp_path: Path) -> None:
    plan = dp_tp_pp_plan(0)
    assert pickle.loads(pickle.dumps(plan.sources)) == list(plan.sources)
    folder = plan.save_code(tmp_path)
    assert [(folder / f"rank{rank}.py").read_text() for rank in range(8)] == list(plan.sources)


def test_one_ranks_posts_and_releases_are_its_part_of_every_ranks() -> None:
    inline = gpt_plan("hybrid", 4, dp=2, tp=2).materialized  # posts: inline messages; releases: a pipeline's boundary messages
    every_post = receive_posts(inline)
    assert every_post
    for rank in range(4):
        assert receive_posts(inline, rank) == {key: value for key, value in every_post.items() if key[1] == rank}
    plan = dp_tp_pp_plan(None)
    every_release = pipeline_releases(plan.materialized, plan.program)
    assert any(every_release)
    for rank in range(8):
        assert rank_releases(plan.materialized, plan.program, rank) == every_release[rank]
