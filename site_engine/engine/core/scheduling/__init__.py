"""The scheduler by ownership (issue 79): state at the bottom, decisions above it, a thin
`Scheduler` on top that orders a step. Each layer imports only those below it (the
`engine-scheduling-layers` contract in pyproject.toml):

    scheduler                           the façade: orders a step, delegates the rest
    admission | running_rows | results  decisions: who joins, what the running rows compute,
                                        what a step's tokens do
    adapter_gate                        whether a candidate's adapter lets it in, once each
    step_plan                           the step being planned (made fresh each step)
    roster                              who is live, waiting, running, in which row and blocks

A shared primitive lives with the state it changes: preempting, picking a victim and checking
for room are the roster's; the chunk, the row taken and the decode taken back are the step
plan's. No part calls up into the façade.
"""
