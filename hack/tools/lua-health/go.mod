// Runs the Argo CD health scripts (config/argocd/*.lua) with gopher-lua, the interpreter Argo CD
// embeds, for operator/tests/argocd.rs. Built by hack/tools.sh as aether-lua-health.
module aether.dev/hack/tools/lua-health

go 1.25.0

require github.com/yuin/gopher-lua v1.1.2
