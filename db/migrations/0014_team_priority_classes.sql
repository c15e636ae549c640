-- The priority classes a team may submit in (docs/security.md, "Priority-class entitlement").
-- NULL: every class, as before this column (an operator restricts a team with
-- PUT /v1/teams/{team}/priority-classes). prod-serving is never preempted and preempts every
-- other class, so a cluster shared by research teams restricts them to what they need.
-- Admission checks it at submit; a change applies to new submissions, not to jobs already queued.
ALTER TABLE teams
    ADD COLUMN priority_classes text[]
        CHECK (
            priority_classes IS NULL
            OR (
                cardinality(priority_classes) BETWEEN 1 AND 4
                AND priority_classes <@ ARRAY['prod-serving', 'prod-batch', 'research', 'preemptible']::text[]
            )
        );
