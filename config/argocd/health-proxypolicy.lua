-- Argo CD health of a proxyshift.io ProxyPolicy (resource.customizations.health.proxyshift.io_ProxyPolicy).
-- Argo CD runs this with gopher-lua (Lua 5.1) and, for argocd-cm scripts, without the string and math
-- libraries (only base, table, package and a safe os): base functions and `..` only here.
-- tests/unit/test_argocd_health.py runs it so (tests/tools/argocd-health-runner). Argo CD never
-- calls it for a policy being deleted: it shows "Progressing: Pending deletion" instead.
-- The order of the checks is the point:
--   1. no status yet            -> Progressing (the operator has not picked the policy up)
--   2. status of an older spec  -> Progressing (a Ready=True left from the previous generation must not
--                                  let a sync wave move on before the operator has seen the new spec)
--   3. Degraded=True            -> Degraded (rollout halted on a failed node; it needs a person)
--   4. phase Conflict           -> Degraded (every selected node belongs to an older policy: no effect)
--   5. paused                   -> Suspended (spec.rollout.paused or Paused=True, as Argo CD does for a
--                                  paused Deployment: a paused policy also holds later sync waves)
--   6. Ready=True               -> Healthy
--   7. anything else            -> Progressing
local hs = {}

local function condition(status, kind)
  if status.conditions == nil then
    return nil
  end
  for _, c in ipairs(status.conditions) do
    if c.type == kind then
      return c
    end
  end
  return nil
end

local function is_true(c)
  return c ~= nil and c.status == "True"
end

local function text(c, fallback)
  if c ~= nil and c.message ~= nil and c.message ~= "" then
    return c.message
  end
  return fallback
end

local function nodes(status)
  if status.progress ~= nil then
    return " (" .. status.progress .. " nodes updated)"
  end
  return ""
end

local status = obj.status
if status == nil or (status.observedGeneration == nil and status.conditions == nil) then
  hs.status = "Progressing"
  hs.message = "Waiting for the proxyshift operator to report status"
  return hs
end

local generation = nil
if obj.metadata ~= nil then
  generation = obj.metadata.generation
end
if generation ~= nil and status.observedGeneration ~= generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the proxyshift operator to observe generation " .. tostring(generation) ..
    " (status describes generation " .. tostring(status.observedGeneration) .. ")"
  return hs
end

local degraded = condition(status, "Degraded")
if is_true(degraded) then
  hs.status = "Degraded"
  hs.message = text(degraded, "Rollout halted") .. nodes(status)
  return hs
end

if status.phase == "Conflict" then
  hs.status = "Degraded"
  hs.message = text(condition(status, "Conflict"), "Every selected node belongs to an older policy")
  return hs
end

local spec_paused = obj.spec ~= nil and obj.spec.rollout ~= nil and obj.spec.rollout.paused == true
local paused = condition(status, "Paused")
if spec_paused or is_true(paused) then
  hs.status = "Suspended"
  hs.message = "Rollout paused (spec.rollout.paused: true): no new node starts" .. nodes(status)
  return hs
end

local ready = condition(status, "Ready")
if is_true(ready) then
  hs.status = "Healthy"
  hs.message = text(ready, "Rollout complete")
  return hs
end

hs.status = "Progressing"
hs.message = text(condition(status, "Progressing"), "Rolling out") .. nodes(status)
return hs
