"""The shipped rollout task set: tiny git repositories with a failing test.

`python -m tools.tasks.build` turns the plain files under `src/` into git
repositories under `build/` (git-ignored; no binary .git is committed) with
fixed author, committer and dates, so every machine gets the commit hashes
`tasks.jsonl` names. `tools.tasks.policy` is a scripted "model" that answers
with the tool calls of a correct (or a wrong) fix for each task.
"""
