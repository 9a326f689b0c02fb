-- Argo CD health check for federation.aether.dev/RegistrySchema.
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
local summary = string.format("%s: %d copied, %d already in v1, %d skipped, %d deleted",
  phase, counts.copied or 0, counts.alreadyPresent or 0, counts.skipped or 0, counts.deleted or 0)
if phase == "Complete" or phase == "DryRunComplete" then
  -- A finished dry run has done all it will do: healthy, and the message says it was a dry run.
  hs.status = "Healthy"
elseif phase == "Failed" then
  hs.status = "Degraded"
  summary = summary .. " (" .. (obj.status.message or "failed") .. ")"
else
  hs.status = "Progressing"
end
hs.message = summary
return hs
