"""runtime.failures: a rank's own error is published once; a communication failure after it names it."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from lightning_nnscaler.codegen import module_from_source
from lightning_nnscaler.runtime.comm import CommunicationError
from lightning_nnscaler.runtime.failures import PeerRankFailed, is_communication_failure, report_failure, where_raised


def _store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=5))


def _raised(function) -> BaseException:  # noqa: ANN001 - any callable that raises
    try:
        function()
    except Exception as error:  # noqa: BLE001 - the error is what is tested
        return error
    raise AssertionError("did not raise")


def _boom() -> None:
    raise ValueError("boom from rank 1")


def test_a_communication_failure_after_a_peers_error_names_the_peer_and_its_error() -> None:
    store = _store()
    own = _raised(_boom)
    assert report_failure(1, own, store=store) is own
    assert report_failure(2, _raised(lambda: {}["later"]), store=store) is not None  # a later own error does not replace the first
    closed = CommunicationError("rank 0: all_reduce over ranks (0, 1) failed: Connection closed by peer")
    peer = report_failure(0, closed, store=store)
    assert isinstance(peer, PeerRankFailed) and peer.failure.rank == 1
    assert str(peer).startswith("rank 0 stopped: waiting for rank 1, which failed: ValueError: boom from rank 1 (in _boom, test_failures.py line")


def test_without_a_peers_report_the_communication_failure_stays_as_it_is() -> None:
    closed = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:6051")
    assert is_communication_failure(closed) and not is_communication_failure(ValueError("boom"))
    assert report_failure(0, closed, store=_store()) is closed


def test_an_error_in_generated_code_names_its_op() -> None:
    module = module_from_source("def forward(x):\n    y = x.missing()  # linear_3: (4, 8)\n    return y\n", "nnscaler_rank1_test")
    assert where_raised(_raised(lambda: module.forward(object()))) == "generated op linear_3, <nnscaler_rank1_test> line 2"
