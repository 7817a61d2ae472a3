"""The failure taxonomy of a rollout.

A failure of the *policy* (wrong patch, tests fail, the agent gave up or ran
out of turns) is not an error: it is reward 0, and the session is trained.
A failure of the *infrastructure* is `InfraError` with a `cause`: the session
closes `aborted` and yields the reducer's same-shape placeholders, so the
model is never punished for a broken machine. Causes:

    sandbox_boot          a sandbox could not be created
    sandbox_gone          a sandbox vanished mid-rollout
    repo_checkout         the repository/commit could not be put in the sandbox
    setup_failed          the task's setup commands failed (before any patch)
    agent_install         the agent CLI is missing and could not be installed
    budget_before_answer  the wall-clock budget ran out before any model answer
    engine_error          the engine failed (the agent's last turn got a 5xx)
    recorder_unreachable  the recorder did not answer
    patch_apply           the agent's own diff did not apply on a clean checkout whose
                          setup made another tree than the agent's (when the trees are the
                          same, a refusal is the agent's doing: reward 0, `failure` says so)
    eval_crashed          the grader could not run (command not found, sandbox error)
    cancelled             the rollout was stopped (Ctrl-C, the trainer cancelled it)
    node_lost             its Ray node (or the worker process) died mid-rollout: the driver
                          closed its session (recorder/rollout/cluster.py)
    driver_error          a bug in the driver (the traceback is logged)
"""

from __future__ import annotations


class InfraError(Exception):
    """Not the model's fault: the rollout is aborted and yields placeholders."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(f"{cause}: {message}")
        self.cause = cause
        self.message = message
