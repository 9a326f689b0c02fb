-- Argo CD health check for federation.aether.dev/RegionPeering.
-- Install: see docs/argocd.md (resource.customizations.health.federation.aether.dev_RegionPeering).
local hs = {}
if obj.status == nil or obj.status.conditions == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to report status"
  return hs
end
if obj.metadata.generation ~= nil and obj.status.observedGeneration ~= nil
    and obj.status.observedGeneration < obj.metadata.generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe the latest spec"
  return hs
end
local c = {}
for _, condition in ipairs(obj.status.conditions) do
  c[condition.type] = condition
end
local function is(t) return c[t] ~= nil and c[t].status == "True" end
if is("Suspended") then
  hs.status = "Suspended"
  hs.message = c["Suspended"].message
  return hs
end
if is("Conflict") then
  hs.status = "Degraded"
  hs.message = c["Conflict"].message
  return hs
end
if is("KeepaliveDegraded") then
  hs.status = "Degraded"
  hs.message = c["KeepaliveDegraded"].message
  return hs
end
if is("Ready") then
  if c["PeersReachable"] ~= nil and c["PeersReachable"].status == "False" then
    hs.status = "Degraded"
    hs.message = c["PeersReachable"].message
    return hs
  end
  hs.status = "Healthy"
  hs.message = c["Ready"].message
  return hs
end
local ready = c["Ready"]
if ready == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the Ready condition"
  return hs
end
local progressing = { PeerNotSynced = true, Syncing = true }
if progressing[ready.reason] then
  hs.status = "Progressing"
else
  hs.status = "Degraded"
end
hs.message = ready.reason .. ": " .. ready.message
return hs
