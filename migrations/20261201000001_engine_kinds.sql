-- Engines that are not ours (vLLM, SGLang), registered by an operator rather than by
-- themselves: their kind, and the spec they were registered with (serve --engine, an
-- --engines file, POST /api/engines), so a restarted control plane registers them again.
ALTER TABLE instances ADD COLUMN kind TEXT NOT NULL DEFAULT 'fleetplane'
    CHECK (kind IN ('fleetplane', 'vllm', 'sglang'));
ALTER TABLE instances ADD COLUMN spec JSONB;
-- `removed`: deregistered by an operator; never recovered.
ALTER TABLE instances DROP CONSTRAINT instances_state_check;
ALTER TABLE instances ADD CONSTRAINT instances_state_check
    CHECK (state IN ('serving', 'draining', 'down', 'removed'));
