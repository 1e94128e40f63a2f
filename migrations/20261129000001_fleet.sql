-- Fleet state of the control plane. Every timestamp is UTC.

CREATE TABLE pools (
    name        TEXT PRIMARY KEY,
    role        TEXT NOT NULL CHECK (role IN ('colocated', 'prefill', 'decode')),
    min_instances INTEGER NOT NULL DEFAULT 0 CHECK (min_instances >= 0),
    max_instances INTEGER NOT NULL DEFAULT 64 CHECK (max_instances >= min_instances),
    created_at  TIMESTAMPTZ NOT NULL DEFAULT now()
);

INSERT INTO pools (name, role) VALUES ('colocated', 'colocated'), ('prefill', 'prefill'), ('decode', 'decode');

-- Engines that ever registered; an engine keeps its id across restarts of either side.
CREATE TABLE instances (
    id              SERIAL PRIMARY KEY,
    address         TEXT NOT NULL UNIQUE,
    name            TEXT NOT NULL,
    pool            TEXT NOT NULL REFERENCES pools (name),
    model           TEXT NOT NULL,
    executor        TEXT NOT NULL,
    block_size      INTEGER NOT NULL,
    kv_blocks       BIGINT NOT NULL,
    capacity_tokens BIGINT NOT NULL,
    state           TEXT NOT NULL CHECK (state IN ('serving', 'draining', 'down')),
    registered_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    last_seen       TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- Routing and scheduling policy, one row per version; the highest version is in force.
CREATE TABLE policy_versions (
    version     SERIAL PRIMARY KEY,
    policy      JSONB NOT NULL,
    author      TEXT NOT NULL,
    created_at  TIMESTAMPTZ NOT NULL DEFAULT now()
);

CREATE TABLE slo_targets (
    id          BOOLEAN PRIMARY KEY DEFAULT TRUE CHECK (id),
    ttft_ms     DOUBLE PRECISION NOT NULL CHECK (ttft_ms > 0),
    tpot_ms     DOUBLE PRECISION NOT NULL CHECK (tpot_ms > 0),
    updated_by  TEXT NOT NULL,
    updated_at  TIMESTAMPTZ NOT NULL DEFAULT now()
);

CREATE TABLE scaling_events (
    id          BIGSERIAL PRIMARY KEY,
    at          TIMESTAMPTZ NOT NULL DEFAULT now(),
    pool        TEXT NOT NULL,
    action      TEXT NOT NULL,
    instance    INTEGER,
    reason      JSONB NOT NULL,
    replica     TEXT NOT NULL
);

CREATE TABLE simulation_runs (
    id          BIGSERIAL PRIMARY KEY,
    scenario    TEXT NOT NULL,
    state       TEXT NOT NULL CHECK (state IN ('queued', 'running', 'done', 'failed')),
    error       TEXT,
    result      JSONB,
    chart_svg   TEXT,
    submitted_by TEXT NOT NULL,
    submitted_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    finished_at TIMESTAMPTZ
);

CREATE TABLE api_tokens (
    id          BIGSERIAL PRIMARY KEY,
    name        TEXT NOT NULL UNIQUE,
    role        TEXT NOT NULL CHECK (role IN ('inference', 'admin')),
    token_sha256 BYTEA NOT NULL UNIQUE,
    created_by  TEXT NOT NULL,
    created_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    revoked_at  TIMESTAMPTZ
);

-- Who changed what, and when.
CREATE TABLE audit_log (
    id          BIGSERIAL PRIMARY KEY,
    at          TIMESTAMPTZ NOT NULL DEFAULT now(),
    actor       TEXT NOT NULL,
    action      TEXT NOT NULL,
    detail      JSONB NOT NULL
);
