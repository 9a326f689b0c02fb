-- Argo CD health check for apiextensions.k8s.io/CustomResourceDefinition: Argo CD's own, except
-- that a CRD the API server is still establishing reads Progressing, not Degraded.
-- Install: docs/operating.md#with-an-argo-cd-application
-- (argocd-cm key resource.customizations.health.apiextensions.k8s.io_CustomResourceDefinition).
-- A new CRD's names are accepted at once, and it is Established a moment later: at once with one
-- API server, after 5 s with more (an HA control plane), later still on a busy one. Until then its
-- Established condition is False with reason Installing. Argo CD's built-in check calls that
-- Degraded ("CRD is not established"), so every first sync of the chart on an HA control plane
-- shows the Application Degraded for 5 s or more. This check applies to every CRD Argo CD shows.
-- Argo CD runs it in gopher-lua (Lua 5.1) with only the base and table libraries: no string.*.
local hs = {}
local function say(status, message)
  hs.status = status
  hs.message = message
  return hs
end
if obj.metadata ~= nil and obj.metadata.deletionTimestamp ~= nil then
  return say("Progressing", "CRD is terminating")
end
local conditions = {}
if obj.status ~= nil and obj.status.conditions ~= nil then
  conditions = obj.status.conditions
end
local c = {}
for _, condition in ipairs(conditions) do
  c[condition.type] = condition
end
local function message(t)
  if c[t].message ~= nil and c[t].message ~= "" then return ": " .. c[t].message end
  return ""
end
if c["Terminating"] ~= nil and c["Terminating"].status == "True" then
  return say("Progressing", "CRD is terminating" .. message("Terminating"))
end
if c["NamesAccepted"] ~= nil and c["NamesAccepted"].status == "False" then
  return say("Degraded", "CRD names have not been accepted" .. message("NamesAccepted"))
end
if c["NonStructuralSchema"] ~= nil and c["NonStructuralSchema"].status == "True" then
  return say("Degraded", "Schema violations found" .. message("NonStructuralSchema"))
end
if c["Established"] ~= nil and c["Established"].status == "True" then
  return say("Healthy", "CRD is healthy")
end
if c["Established"] == nil or c["Established"].reason == "Installing" then
  -- No conditions yet (the naming controller has not run), or names accepted and not yet
  -- Established: the API server is on its way.
  return say("Progressing", "CRD is being established")
end
return say("Degraded", "CRD is not established" .. message("Established"))
