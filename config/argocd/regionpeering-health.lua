-- Argo CD health check for federation.aether.dev/RegionPeering.
-- Install: docs/operating.md#with-an-argo-cd-application
-- (argocd-cm key resource.customizations.health.federation.aether.dev_RegionPeering).
-- Argo CD runs it in gopher-lua (Lua 5.1) with only the base and table libraries: no string.*.
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
local function isFalse(t) return c[t] ~= nil and c[t].status == "False" end
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
  if isFalse("PeersReachable") then
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
if ready.reason == "PeerNotSynced" then
  -- Syncing is progress; a peer whose sessions keep failing (Backoff, with the error) or that
  -- does not answer is not, even before its first sync completes.
  local failing = {}
  for _, peer in ipairs(obj.status.peers or {}) do
    if peer.phase == "Backoff" then
      table.insert(failing, peer.region .. ": Backoff: " .. (peer.lastError or "no error recorded"))
    end
  end
  if #failing > 0 then
    hs.status = "Degraded"
    hs.message = table.concat(failing, "; ")
    return hs
  end
  if isFalse("PeersReachable") then
    hs.status = "Degraded"
    hs.message = c["PeersReachable"].message
    return hs
  end
  hs.status = "Progressing"
else
  hs.status = "Degraded"
end
hs.message = ready.reason .. ": " .. ready.message
return hs
