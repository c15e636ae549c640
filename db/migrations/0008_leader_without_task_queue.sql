-- The leader runs its placement cycles itself (docs/design.md, Leadership): no workflow
-- schedules a cycle activity on the leader's own task queue any more, so the row no longer
-- names one.
ALTER TABLE leader DROP COLUMN task_queue;
