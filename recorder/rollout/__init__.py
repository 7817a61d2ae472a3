"""The rollout driver: task -> sandbox -> agent -> diff -> evaluation -> reward -> samples.

It talks to the recorder only over its HTTP API (it runs inside trainers'
workers on other machines), so nothing here imports `recorder.server` or
`recorder.log.store`.
"""
