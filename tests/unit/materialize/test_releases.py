"""``materialize.releases``: which sent message the receipt of a later one proves taken."""

from __future__ import annotations

import torch

import lightning_nnscaler as lnn
from lightning_nnscaler.materialize.releases import Message, Posted, boundary_messages, send_releases
from lightning_nnscaler.models.gpt import GPT, GPTConfig


def one_f_one_b_posts() -> list[list[Posted]]:
    """Two stages, three microbatches, 1F1B: activation ``a{m}`` forward, gradient ``g{m}`` back."""
    first = [Posted("send", 1, "a0"), Posted("send", 1, "a1"), Posted("recv", 1, "g0"), Posted("send", 1, "a2"),
             Posted("recv", 1, "g1"), Posted("recv", 1, "g2")]
    last = [Posted("recv", 0, "a0"), Posted("send", 0, "g0"), Posted("recv", 0, "a1"), Posted("send", 0, "g1"),
            Posted("recv", 0, "a2"), Posted("send", 0, "g2")]
    return [first, last]


def test_a_receipt_releases_what_its_sender_had_taken_before_sending_it() -> None:
    first, last = send_releases(one_f_one_b_posts())
    # g0 was sent after the last stage took a0 (and nothing else): a0's copy goes when g0 arrives, and so on
    assert first == {"g0": ["a0"], "g1": ["a1"], "g2": ["a2"]}
    # the first stage took g0 before sending a2: a2's arrival releases g0; g1 and g2 have no later answer
    assert last == {"a2": ["g0"]}


def test_a_message_nobody_receives_is_never_released() -> None:
    first, last = send_releases([[Posted("send", 1, "lost"), Posted("send", 1, "a")], [Posted("recv", 0, "a"), Posted("send", 0, "b")]])
    assert first == {"b": ["a"]} and last == {}


def test_a_generated_1f1b_plan_posts_its_boundary_messages_in_the_runtimes_order() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=8, hidden=16, layers=2, heads=2))
    model.log = lambda *args, **kwargs: None
    plan = lnn.parallelize(model, model.example_batch(4, torch.Generator().manual_seed(0)), "1f1b", 2,
                           step="training_step", stages=2, microbatches=2)
    first, last = boundary_messages(plan.materialized, plan.program)
    assert [(post.kind, post.message.gradient) for post in first] == [
        ("send", False), ("send", False), ("recv", True), ("recv", True)]  # F0 F1 B0 B1
    assert [(post.kind, post.message.gradient) for post in last] == [
        ("recv", False), ("send", True), ("recv", False), ("send", True)]  # F0 B0 F1 B1
    assert all(isinstance(post.message, Message) and post.message.src != post.message.dst for post in first + last)
    assert "RELEASES = {" in plan.sources[0] and "# message received (from rank, tag, is a gradient)" in plan.sources[0]
