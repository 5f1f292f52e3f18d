// Command argocd-health-runner evaluates an Argo CD resource health script the way the Argo CD
// application controller does for a script from argocd-cm, and prints the verdict as JSON.
//
//	argocd-health-runner [-script-only] SCRIPT OBJECT.json
//
// prints {"status": "...", "message": "..."} and exits 0 when Argo CD would show that health;
// when Argo CD would record an evaluation error (the script fails, times out or returns no
// table), it prints {"status": "Unknown", "message": ERROR, "error": ERROR} and exits 1.
// Usage and input errors exit 2.
//
// What is mirrored, from reading Argo CD 3.6 (argoproj/argo-cd at 37ee0097: util/lua/lua.go,
// util/lua/oslib_safe.go, gitops-engine/pkg/health/health.go); written anew, not copied:
//   - gopher-lua (Lua 5.1) with SkipOpenLibs: an argocd-cm script without
//     resource.customizations.useOpenLibs gets only the package, base and table libraries and a
//     "safe os" (time and date only). Argo CD opens that safe os under the table library's
//     name, which is loaded already, so the opener adds nothing: the global os is nil and only
//     `require("os")` returns the two functions. No string, math, io, coroutine, debug or
//     channel library, and no string metatable (no ("x"):upper()).
//   - the object as the global `obj`, decoded as client-go's unstructured decodes JSON
//     (integers int64, other numbers float64) and turned into Lua tables one to one.
//   - a one-second deadline on the whole run.
//   - the result: the last value on the stack. A table is encoded to JSON with
//     layeh.com/gopher-json and read into {status, message}: an empty table (or a field of the
//     wrong JSON type) gives an empty health, a status outside Argo CD's six gives Unknown "Lua
//     returned an invalid health status". nil gives an empty health, anything else an error.
//   - before any script (unless -script-only): an object with metadata.deletionTimestamp and
//     without Argo CD's hook finalizer is "Progressing: Pending deletion", whatever the script
//     would say.
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"slices"
	"time"

	lua "github.com/yuin/gopher-lua"
	luajson "layeh.com/gopher-json"
)

const (
	scriptDeadline       = time.Second
	hookFinalizer        = "argocd.argoproj.io/hook-finalizer"
	invalidHealthMessage = "Lua returned an invalid health status"
)

// validStatuses are gitops-engine's health.HealthStatusCode values.
var validStatuses = []string{"Unknown", "Progressing", "Suspended", "Healthy", "Degraded", "Missing"}

// health has the JSON shape of gitops-engine's health.HealthStatus, so decoding the script's
// table fails or succeeds exactly where Argo CD's does.
type health struct {
	Status  string `json:"status,omitempty"`
	Message string `json:"message,omitempty"`
}

type verdict struct {
	Status  string `json:"status"`
	Message string `json:"message"`
	Error   string `json:"error,omitempty"`
}

func main() {
	scriptOnly := flag.Bool("script-only", false,
		"run the script even for an object being deleted (Argo CD itself never does)")
	flag.Usage = func() {
		fmt.Fprintln(os.Stderr, "usage: argocd-health-runner [-script-only] SCRIPT OBJECT.json")
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() != 2 {
		flag.Usage()
		os.Exit(2)
	}
	script, err := os.ReadFile(flag.Arg(0))
	if err != nil {
		fail(err)
	}
	raw, err := os.ReadFile(flag.Arg(1))
	if err != nil {
		fail(err)
	}
	obj, err := decodeObject(raw)
	if err != nil {
		fail(fmt.Errorf("%s: %w", flag.Arg(1), err))
	}

	var out verdict
	code := 0
	if h, evalErr := resourceHealth(obj, string(script), *scriptOnly); evalErr != nil {
		// The controller records an evaluation error as health Unknown with the error as message.
		out = verdict{Status: "Unknown", Message: evalErr.Error(), Error: evalErr.Error()}
		code = 1
	} else {
		out = verdict{Status: h.Status, Message: h.Message}
	}
	enc := json.NewEncoder(os.Stdout)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(out); err != nil {
		fail(err)
	}
	os.Exit(code)
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "argocd-health-runner:", err)
	os.Exit(2)
}

// decodeObject reads JSON as unstructured.Unstructured holds it: numbers that are integers become
// int64, others float64, so the Lua side sees the same numbers the controller's cache has.
func decodeObject(raw []byte) (map[string]any, error) {
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	var obj map[string]any
	if err := dec.Decode(&obj); err != nil {
		return nil, err
	}
	if obj == nil {
		return nil, errors.New("not a JSON object")
	}
	return convertNumbers(obj).(map[string]any), nil
}

func convertNumbers(value any) any {
	switch v := value.(type) {
	case map[string]any:
		for key, item := range v {
			v[key] = convertNumbers(item)
		}
	case []any:
		for i, item := range v {
			v[i] = convertNumbers(item)
		}
	case json.Number:
		if n, err := v.Int64(); err == nil {
			return n
		}
		if f, err := v.Float64(); err == nil {
			return f
		}
	}
	return value
}

// resourceHealth is the controller's order: the deletion short cut first, then the script.
func resourceHealth(obj map[string]any, script string, scriptOnly bool) (health, error) {
	if !scriptOnly && beingDeleted(obj) {
		return health{Status: "Progressing", Message: "Pending deletion"}, nil
	}
	return runHealthScript(obj, script)
}

func beingDeleted(obj map[string]any) bool {
	meta, _ := obj["metadata"].(map[string]any)
	stamp, _ := meta["deletionTimestamp"].(string)
	if stamp == "" {
		return false
	}
	finalizers, _ := meta["finalizers"].([]any)
	return !slices.Contains(finalizers, any(hookFinalizer))
}

func runHealthScript(obj map[string]any, script string) (health, error) {
	l := lua.NewState(lua.Options{SkipOpenLibs: true})
	defer l.Close()
	if err := openArgoLibraries(l); err != nil {
		return health{}, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), scriptDeadline)
	defer cancel()
	l.SetContext(ctx)
	l.SetGlobal("obj", toLua(l, obj))

	fn, err := l.LoadString(script)
	if err == nil {
		l.Push(fn)
		err = l.PCall(0, lua.MultRet, nil)
	}
	if err != nil {
		var apiErr *lua.ApiError
		if errors.As(err, &apiErr) && apiErr.Type == lua.ApiErrorRun {
			// Argo CD drops the Lua stack trace from run-time errors before showing them.
			apiErr.StackTrace = ""
			return health{}, apiErr
		}
		return health{}, err
	}
	return readResult(l.Get(-1))
}

// openArgoLibraries opens what Argo CD opens for an argocd-cm script, each called like a Lua
// library opener with its name as the argument.
func openArgoLibraries(l *lua.LState) error {
	safeOs, err := safeOsFunctions()
	if err != nil {
		return err
	}
	openSafeOs := func(l *lua.LState) int {
		// As in Argo CD: registered under the table library's name, already in _LOADED, so this
		// returns the table library unchanged and defines no global os.
		l.Push(l.RegisterModule(lua.TabLibName, safeOs))
		return 1
	}
	for _, lib := range []struct {
		name string
		open lua.LGFunction
	}{
		{lua.LoadLibName, lua.OpenPackage},
		{lua.BaseLibName, lua.OpenBase},
		{lua.TabLibName, lua.OpenTable},
		{lua.OsLibName, openSafeOs},
	} {
		if err := l.CallByParam(lua.P{Fn: l.NewFunction(lib.open), NRet: 0, Protect: true},
			lua.LString(lib.name)); err != nil {
			return fmt.Errorf("opening %s: %w", lib.name, err)
		}
	}
	l.PreloadModule(lua.OsLibName, func(l *lua.LState) int {
		l.Push(l.SetFuncs(l.NewTable(), safeOs))
		return 1
	})
	return nil
}

// safeOsFunctions takes os.time and os.date from gopher-lua's own os library, the code Argo CD's
// safe subset was made from, in a scratch state (a Go function value works in any state).
func safeOsFunctions() (map[string]lua.LGFunction, error) {
	scratch := lua.NewState(lua.Options{SkipOpenLibs: true})
	defer scratch.Close()
	if err := scratch.CallByParam(lua.P{Fn: scratch.NewFunction(lua.OpenOs), NRet: 1, Protect: true},
		lua.LString(lua.OsLibName)); err != nil {
		return nil, err
	}
	mod, ok := scratch.Get(-1).(*lua.LTable)
	if !ok {
		return nil, errors.New("gopher-lua's os library opened no table")
	}
	funcs := map[string]lua.LGFunction{}
	for _, name := range []string{"time", "date"} {
		fn, ok := mod.RawGetString(name).(*lua.LFunction)
		if !ok || fn.GFunction == nil {
			return nil, fmt.Errorf("gopher-lua's os library has no %s", name)
		}
		funcs[name] = fn.GFunction
	}
	return funcs, nil
}

// toLua turns a decoded object into Lua values as Argo CD does: maps and arrays become tables,
// numbers LNumber, a json.Number (never produced by decodeObject) a string, anything else nil.
func toLua(l *lua.LState, value any) lua.LValue {
	switch v := value.(type) {
	case bool:
		return lua.LBool(v)
	case float64:
		return lua.LNumber(v)
	case int64:
		return lua.LNumber(v)
	case string:
		return lua.LString(v)
	case json.Number:
		return lua.LString(v)
	case []any:
		arr := l.CreateTable(len(v), 0)
		for _, item := range v {
			arr.Append(toLua(l, item))
		}
		return arr
	case map[string]any:
		tbl := l.CreateTable(0, len(v))
		for key, item := range v {
			tbl.RawSetH(lua.LString(key), toLua(l, item))
		}
		return tbl
	}
	return lua.LNil
}

func readResult(ret lua.LValue) (health, error) {
	switch ret.Type() {
	case lua.LTNil:
		return health{}, nil
	case lua.LTTable:
	default:
		return health{}, fmt.Errorf("expect table output from Lua script, not %s", ret.Type().String())
	}
	encoded, err := luajson.Encode(ret)
	if err != nil {
		return health{}, err
	}
	var h health
	if err := json.Unmarshal(encoded, &h); err != nil {
		// Argo CD means to accept an empty table (encoded as []) as an empty health, but its
		// errors.As matches every type mismatch: a numeric message, say, also gives an empty
		// health rather than an error. Mirrored as it behaves.
		var typeErr *json.UnmarshalTypeError
		if errors.As(err, &typeErr) {
			return health{}, nil
		}
		return health{}, err
	}
	if !slices.Contains(validStatuses, h.Status) {
		return health{Status: "Unknown", Message: invalidHealthMessage}, nil
	}
	return h, nil
}
