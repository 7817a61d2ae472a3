"""Trainer hooks: slime's custom generate and verl's agent loop, over one rollout driver.

    slime  --custom-generate-function-path recorder.integrations.slime.generate
    verl   agent_name "recorder" -> recorder.integrations.verl.RecorderAgentLoop

Each hook is a thin converter. All the work (task -> sandbox -> agent pointed at
the recorder -> evaluation -> close -> samples) is `recorder.rollout.driver.
run_rollout`; `common` turns a trainer's settings and dataset row into one
`RolloutRequest` and runs it without ever raising; `slime` and `verl_outputs`
turn `replay.samples.Sample`s into the trainer's own types with pure functions.
The hooks run inside trainers' Ray workers on other machines, so nothing here
assumes the recorder, its log or the sandbox is local: everything is reached
by URL. Nothing here imports `recorder.server` or `recorder.log.store`.
"""
