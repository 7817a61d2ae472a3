"""What only the E2B backend does: boots through E2B's API (retries, rate limits, the boot
cap), the spec reaching the cloud, and a sandbox vanishing under a running command.

Everything runs the real SDK against `E2BDoubles` (see e2b_doubles.py); the shared
behaviour of every backend is in test_sandbox_suite.py.
"""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Any

import pytest

from recorder.rollout.sandbox import (
    SandboxBootError,
    SandboxGone,
    SandboxSpec,
    open_sandbox,
)

try:
    from e2b import AsyncSandbox
    from e2b_doubles import E2BDoubles

    from recorder.rollout.sandbox.e2b import backoff_s
except ImportError:  # the e2b extra; CI installs it, so there a missing SDK fails collection
    if os.environ.get("CI"):
        raise
    pytest.skip("the E2B SDK is not installed (pip install -e '.[e2b]')", allow_module_level=True)


def spec(doubles: E2BDoubles, **options: Any) -> SandboxSpec:
    return SandboxSpec(backend="e2b", options=doubles.sdk_options(**options))


def connection(doubles: E2BDoubles) -> dict[str, Any]:
    """The SDK's own connection settings for the doubles (for calls made without the backend)."""
    return {
        "api_url": doubles.api_url,
        "sandbox_url": doubles.sandbox_url,
        "api_key": "e2b_" + "0" * 40,
    }


async def test_the_spec_reaches_the_api(e2b_doubles: E2BDoubles) -> None:
    wanted = SandboxSpec(
        backend="e2b",
        template="swe-python",
        metadata={"rollout": "r-1", "task": "t-7"},
        env={"FROM_SPEC": "1"},
        timeout_s=89.5,
        options=e2b_doubles.sdk_options(),
    )
    async with await open_sandbox(wanted) as sb:
        info = await AsyncSandbox.get_info(sb.id, **connection(e2b_doubles))
        assert info.template_id == "swe-python"
        assert info.metadata == {"rollout": "r-1", "task": "t-7"}
        lifetime = info.end_at - info.started_at
        assert round(lifetime.total_seconds()) == 90  # rounded up to whole seconds
        assert (await sb.exec("echo $FROM_SPEC")).stdout == "1\n"


@pytest.mark.parametrize("status", [429, 500, 502, 503])
async def test_transient_boot_failures_are_retried(e2b_doubles: E2BDoubles, status: int) -> None:
    e2b_doubles.fail_creates(status, status)
    async with await open_sandbox(spec(e2b_doubles)) as sb:
        assert (await sb.exec("echo up")).stdout == "up\n"
    assert e2b_doubles.create_statuses == [status, status, 201]


async def test_a_rate_limit_that_outlasts_the_attempts_is_a_boot_error(
    e2b_doubles: E2BDoubles,
) -> None:
    e2b_doubles.fail_creates(429, 429, 429)
    with pytest.raises(SandboxBootError, match=r"3 attempt.*RateLimitException"):
        await open_sandbox(spec(e2b_doubles, boot_attempts=3))
    assert e2b_doubles.create_attempts == 3
    assert e2b_doubles.live() == []


@pytest.mark.parametrize("status", [400, 404])
async def test_a_refused_boot_is_not_retried(e2b_doubles: E2BDoubles, status: int) -> None:
    e2b_doubles.fail_creates(status)
    with pytest.raises(SandboxBootError):
        await open_sandbox(spec(e2b_doubles))
    assert e2b_doubles.create_attempts == 1


async def test_a_wrong_api_key_is_a_boot_error_that_says_what_to_set(
    e2b_doubles: E2BDoubles,
) -> None:
    with pytest.raises(SandboxBootError, match="E2B_API_KEY"):
        await open_sandbox(spec(e2b_doubles, api_key="e2b_wrong"))
    assert e2b_doubles.create_attempts == 0  # refused before any creation


async def test_an_unreachable_api_is_a_boot_error(e2b_doubles: E2BDoubles) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens once it is closed
    with pytest.raises(SandboxBootError, match="2 attempt"):
        await open_sandbox(spec(e2b_doubles, api_url=f"http://127.0.0.1:{port}", boot_attempts=2))


async def test_a_sandbox_whose_envd_never_answers_is_removed_and_booted_again(
    e2b_doubles: E2BDoubles,
) -> None:
    e2b_doubles.envd_down(1)
    async with await open_sandbox(spec(e2b_doubles)) as sb:
        assert (await sb.exec("echo up")).stdout == "up\n"
        first, second = e2b_doubles.sandboxes.values()
        assert (first.alive, second.id) == (False, sb.id)  # the dead VM was not left running


async def test_boots_are_capped_per_process(e2b_doubles: E2BDoubles) -> None:
    gate = e2b_doubles.hold_creates()
    boots = [
        asyncio.ensure_future(open_sandbox(spec(e2b_doubles, max_concurrent_boots=2)))
        for _ in range(5)
    ]
    try:
        while e2b_doubles.in_flight < 2:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # room for a third creation to arrive, were the cap broken
        assert e2b_doubles.in_flight == 2
    finally:
        gate.set()
    for sb in await asyncio.gather(*boots):
        await sb.kill()
    assert (e2b_doubles.create_attempts, e2b_doubles.max_in_flight) == (5, 2)


async def test_a_sandbox_that_vanishes_under_a_command_is_gone(e2b_doubles: E2BDoubles) -> None:
    sb = await open_sandbox(spec(e2b_doubles))
    handle = await sb.start("sleep 300")
    await e2b_doubles.expire(sb.id)
    with pytest.raises(SandboxGone):
        await handle.wait(timeout_s=30)
    with pytest.raises(SandboxGone):
        await sb.write_file("x.txt", "x")
    await handle.kill()  # nothing left to kill: no error
    await sb.kill()


def test_backoff_doubles_with_jitter_and_is_capped() -> None:
    for attempt in range(8):
        step = min(0.5 * 2**attempt, 30.0)
        assert step / 2 <= backoff_s(attempt, 0.5) <= step


async def test_the_sdk_lists_and_reconnects_to_a_running_command(e2b_doubles: E2BDoubles) -> None:
    """The envd double's List and Connect, which the backend does not use, for the SDK directly."""
    sdk = await AsyncSandbox.create(**connection(e2b_doubles))
    try:
        handle = await sdk.commands.run("sleep 300", background=True)
        listed = await sdk.commands.list()
        assert [p.pid for p in listed] == [handle.pid]
        assert listed[0].args[-1] == "sleep 300"
        again = await sdk.commands.connect(handle.pid)
        assert await sdk.commands.kill(handle.pid)
        ended = await asyncio.gather(handle.wait(), again.wait(), return_exceptions=True)
        assert [getattr(e, "exit_code", None) for e in ended] == [-1, -1]
        assert not await sdk.commands.kill(handle.pid)  # gone: not found
    finally:
        await sdk.kill()
    assert e2b_doubles.live() == []


async def test_options_given_as_strings_work(e2b_doubles: E2BDoubles) -> None:
    """`recorder rollout --sandbox-option KEY=VALUE` hands every value over as a string."""
    options = {"request_timeout": "30", "boot_attempts": "2", "max_concurrent_boots": "4"}
    e2b_doubles.fail_creates(503)
    async with await open_sandbox(spec(e2b_doubles, **options)) as sb:
        assert (await sb.exec("echo ok")).stdout == "ok\n"
    assert e2b_doubles.create_statuses == [503, 201]


async def test_the_sdk_uses_the_filesystem_service(e2b_doubles: E2BDoubles) -> None:
    """The envd double's filesystem RPCs, which the backend does not use, for the SDK directly."""
    sdk = await AsyncSandbox.create(**connection(e2b_doubles))
    try:
        assert await sdk.files.make_dir("a/b")
        assert not await sdk.files.make_dir("a/b")  # already there
        await sdk.files.write("a/b/f.txt", "12345")
        assert await sdk.files.exists("a/b/f.txt")
        info = await sdk.files.get_info("a/b/f.txt")
        assert (info.name, info.size, info.type.value) == ("f.txt", 5, "file")
        listed = await sdk.files.list("a", depth=2)
        assert sorted(e.name for e in listed) == ["b", "f.txt"]
        await sdk.files.rename("a/b/f.txt", "a/g.txt")
        assert await sdk.files.read("a/g.txt") == "12345"
        await sdk.files.remove("a")
        assert not await sdk.files.exists("a")
    finally:
        await sdk.kill()


async def test_a_creation_whose_answer_is_lost_leaves_no_orphan(e2b_doubles: E2BDoubles) -> None:
    e2b_doubles.lose_create_answers(1)
    async with await open_sandbox(spec(e2b_doubles)) as sb:
        assert (await sb.exec("echo up")).stdout == "up\n"
        assert e2b_doubles.create_statuses == [0, 201]  # the retry reused the idempotency key
        assert [s.id for s in e2b_doubles.live()] == [sb.id]


async def test_the_sdk_lists_sandboxes_and_extends_their_lifetime(e2b_doubles: E2BDoubles) -> None:
    """The API double's list and timeout routes, for the SDK directly."""
    async with await open_sandbox(spec(e2b_doubles)) as sb:
        page = AsyncSandbox.list(**connection(e2b_doubles))
        assert [s.sandbox_id for s in await page.next_items()] == [sb.id]
        await AsyncSandbox.set_timeout(sb.id, 7200, **connection(e2b_doubles))
        info = await AsyncSandbox.get_info(sb.id, **connection(e2b_doubles))
        remaining = (info.end_at - info.started_at).total_seconds()
        assert remaining >= 7200
    page = AsyncSandbox.list(**connection(e2b_doubles))
    assert await page.next_items() == []


async def test_a_commands_duration_includes_its_start(e2b_doubles: E2BDoubles) -> None:
    """A busy VM's envd can take seconds to start a process: that is the command's time too
    (the driver's command_run events and timings would otherwise leave it out)."""
    async with await open_sandbox(spec(e2b_doubles)) as sb:
        e2b_doubles.start_latency_s = 0.5
        result = await sb.exec("true")
    assert result.exit_code == 0 and result.duration_s >= 0.5
