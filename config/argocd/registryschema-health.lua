-- Argo CD health check for federation.aether.dev/RegistrySchema.
-- Install: docs/operating.md#with-an-argo-cd-application
-- (argocd-cm key resource.customizations.health.federation.aether.dev_RegistrySchema).
-- Argo CD runs it in gopher-lua (Lua 5.1) with only the base and table libraries: no string.*.
local hs = {}
if obj.status == nil or obj.status.phase == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to start the drain"
  return hs
end
if obj.metadata.generation ~= nil and obj.status.observedGeneration ~= nil
    and obj.status.observedGeneration < obj.metadata.generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe the latest spec"
  return hs
end
local phase = obj.status.phase
local counts = obj.status.counts or {}
local summary = phase .. ": " .. (counts.copied or 0) .. " copied, " .. (counts.alreadyPresent or 0)
  .. " already in v1, " .. (counts.skipped or 0) .. " skipped, " .. (counts.deleted or 0) .. " deleted"
if phase == "Complete" or phase == "DryRunComplete" then
  -- A finished dry run has done all it will do: healthy, and the message says it was a dry run.
  hs.status = "Healthy"
elseif phase == "Failed" then
  hs.status = "Degraded"
else
  hs.status = "Progressing"
end
-- The operator's own words: why it failed, or the error a running drain retries after.
if obj.status.message ~= nil and obj.status.message ~= "" then
  summary = summary .. " (" .. obj.status.message .. ")"
elseif phase == "Failed" then
  summary = summary .. " (failed)"
end
hs.message = summary
return hs
