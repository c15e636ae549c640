"""The public REST API (FastAPI): ``api.main.create_app(settings=None, *, pool=None, temporal_client=None)``.

Routes (every ``/v1`` route needs ``Authorization: Bearer <token>``; every write an ``Idempotency-Key``):

    GET    /healthz                       no auth; 200 when the database answers
    GET    /v1/me                         who the token stands for
    POST   /v1/jobs                       submit (admission-checked) -> 202 {job_id, state, queue_position}
    GET    /v1/jobs?team=&state=&cursor=&limit=
    GET    /v1/jobs/{id}                  state, attempt, allocation {nodes, blocks}, queue position, pending reason
    DELETE /v1/jobs/{id}?reason=          signal cancel -> 202 {"state": "CANCELLING"}
    POST   /v1/jobs/{id}:extend           {"by": "2h", "reason"} -> the job workflow's decision
    GET    /v1/jobs/{id}/events           the job's timeline
    GET    /v1/jobs/{id}/logs?rank=&attempt=&follow=&offset=   proxied from the node's agent
    GET    /v1/jobs/{id}/explain          why pending, what it waits for, expected start
    GET    /v1/teams/{team}/quota         {"h100": {"guaranteed", "in_use", "borrowed", "borrow_limit"}}
    PUT    /v1/teams/{team}/quota         admin; {"gpu_type", "guaranteed", "borrow_limit"?, "reason"}
    GET    /v1/teams/{team}/queue         queued jobs in order, usage, counts
    GET    /v1/nodes, /v1/nodes/{id}      state, GPUs, leases
    POST   /v1/nodes/{id}:drain           admin; {"reason", "evict"?}

Modules: ``main`` (app factory), ``routes/`` (one module per resource), ``schemas``,
``auth`` (tokens -> principals), ``idempotency``, ``admission``, ``repository`` (all SQL),
``gateway`` (the only Temporal calls), ``logs_proxy`` (the only agent calls),
``errors`` + ``middleware`` (one error shape, request ids, size limit).
"""
