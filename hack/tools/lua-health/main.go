// Command aether-lua-health runs an Argo CD resource health script the way Argo CD runs it: in
// gopher-lua (Lua 5.1), with only the package, base and table libraries open (Argo CD's default
// for resource.customizations; -open-libs opens all of them, as
// resource.customizations.useOpenLibs does), the object as the global `obj` (JSON objects become
// tables keyed by string, arrays 1-based tables, integers numbers), a one second limit, and the
// chunk's last returned value read as {status, message}.
//
//	aether-lua-health [-open-libs] SCRIPT [OBJECT.json]   (the object from stdin without a file)
//
// It prints `status|message` and a newline, or exits non-zero with the Lua error.
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"time"

	lua "github.com/yuin/gopher-lua"
)

// The statuses Argo CD accepts from a health script; anything else shows as Unknown.
var validStatus = map[string]bool{
	"Unknown": true, "Progressing": true, "Suspended": true, "Healthy": true, "Degraded": true, "Missing": true,
}

func main() {
	openLibs := flag.Bool("open-libs", false, "open every standard library (resource.customizations.useOpenLibs)")
	flag.Usage = func() {
		fmt.Fprintln(flag.CommandLine.Output(), "usage: aether-lua-health [-open-libs] SCRIPT [OBJECT.json]")
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() < 1 || flag.NArg() > 2 {
		flag.Usage()
		os.Exit(2)
	}
	status, message, err := run(flag.Arg(0), flag.Arg(1), *openLibs)
	if err != nil {
		fmt.Fprintf(os.Stderr, "aether-lua-health: %v\n", err)
		os.Exit(1)
	}
	fmt.Printf("%s|%s\n", status, message)
}

func run(scriptPath, objectPath string, openLibs bool) (string, string, error) {
	script, err := os.ReadFile(scriptPath)
	if err != nil {
		return "", "", err
	}
	var raw []byte
	if objectPath == "" || objectPath == "-" {
		raw, err = io.ReadAll(os.Stdin)
	} else {
		raw, err = os.ReadFile(objectPath)
	}
	if err != nil {
		return "", "", err
	}
	object, err := decodeJSON(raw)
	if err != nil {
		return "", "", fmt.Errorf("the object: %w", err)
	}
	if _, ok := object.(map[string]any); !ok {
		return "", "", errors.New("the object must be a JSON object")
	}

	l := lua.NewState(lua.Options{SkipOpenLibs: !openLibs})
	defer l.Close()
	for _, lib := range []struct {
		name string
		open lua.LGFunction
	}{
		{lua.LoadLibName, lua.OpenPackage},
		{lua.BaseLibName, lua.OpenBase},
		{lua.TabLibName, lua.OpenTable},
	} {
		if err := l.CallByParam(lua.P{Fn: l.NewFunction(lib.open), NRet: 0, Protect: true}, lua.LString(lib.name)); err != nil {
			return "", "", err
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	l.SetContext(ctx)
	l.SetGlobal("obj", toLua(l, object))
	if err := l.DoString(string(script)); err != nil {
		return "", "", err
	}
	result, ok := l.Get(-1).(*lua.LTable)
	if !ok {
		return "", "", fmt.Errorf("expect table output from Lua script, not %s", l.Get(-1).Type())
	}
	status, err := stringField(result, "status")
	if err != nil {
		return "", "", err
	}
	message, err := stringField(result, "message")
	if err != nil {
		return "", "", err
	}
	if !validStatus[status] {
		return "Unknown", "Lua returned an invalid health status", nil
	}
	return status, message, nil
}

// stringField reads a field that must be a string or absent, as Argo CD's decoding of the
// returned table into its health status requires.
func stringField(t *lua.LTable, name string) (string, error) {
	switch v := t.RawGetString(name).(type) {
	case *lua.LNilType:
		return "", nil
	case lua.LString:
		return string(v), nil
	default:
		return "", fmt.Errorf("the returned %s is a %s, not a string", name, v.Type())
	}
}

// decodeJSON decodes like Kubernetes' unstructured objects do: integers as int64, other numbers
// as float64.
func decodeJSON(raw []byte) (any, error) {
	d := json.NewDecoder(bytes.NewReader(raw))
	d.UseNumber()
	var v any
	if err := d.Decode(&v); err != nil {
		return nil, err
	}
	if d.More() {
		return nil, errors.New("more than one JSON value")
	}
	return convertNumbers(v)
}

func convertNumbers(v any) (any, error) {
	switch t := v.(type) {
	case json.Number:
		if i, err := t.Int64(); err == nil {
			return i, nil
		}
		return t.Float64()
	case []any:
		for i := range t {
			c, err := convertNumbers(t[i])
			if err != nil {
				return nil, err
			}
			t[i] = c
		}
	case map[string]any:
		for k := range t {
			c, err := convertNumbers(t[k])
			if err != nil {
				return nil, err
			}
			t[k] = c
		}
	}
	return v, nil
}

// toLua converts a decoded object the way Argo CD hands it to a health script.
func toLua(l *lua.LState, v any) lua.LValue {
	switch t := v.(type) {
	case bool:
		return lua.LBool(t)
	case int64:
		return lua.LNumber(t)
	case float64:
		return lua.LNumber(t)
	case string:
		return lua.LString(t)
	case []any:
		arr := l.CreateTable(len(t), 0)
		for _, item := range t {
			arr.Append(toLua(l, item))
		}
		return arr
	case map[string]any:
		tbl := l.CreateTable(0, len(t))
		for k, item := range t {
			tbl.RawSetH(lua.LString(k), toLua(l, item))
		}
		return tbl
	}
	return lua.LNil
}
