"""`gpufleet chaos`: a fault-injection run on its own embedded stack, judged by an independent checker.

timeline.py   what a run did: submissions, injected faults, the leader rows it saw
schedule.py   the seeded fault schedule (pure)
stack.py      the embedded stack: Postgres, Temporal, two controls, agents, the API
workload.py   the mixed workload, submitted over HTTP
faults.py     injects the scheduled faults into the stack
history.py    reads what happened: Postgres, Temporal visibility, the agents' records
checker.py    the invariants, judged over a history and the run's timeline
run.py        one run: stack up, workload and faults, settle, check, report
"""
