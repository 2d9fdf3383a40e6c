// Command plugreg-pm-harness runs the real kubelet plugin manager
// (k8s.io/kubernetes/pkg/kubelet/pluginmanager, Kubernetes v1.20) on a
// registration directory and reports every handler call as one JSON line on
// stdout, so that plugreg's tests can check its registrar against the real
// kubelet side of the protocol.
//
// It is plugreg's own code. interop/build-peers.sh copies it into the
// Kubernetes source tree at cmd/plugreg-pm-harness and builds it there in
// GOPATH mode.
//
// Output (one object per line, flushed at once):
//
//	{"event":"ready","ts_ns":N}
//	{"event":"validate"|"register"|"deregister","type":"CSIPlugin","name":"...","endpoint":"...","versions":[...],"ts_ns":N}
//
// Flags: --dir DIR (created if missing), --reject NAME[,NAME...] (those
// plugin names fail ValidatePlugin with "rejected by harness"),
// --fail-register NAME[,NAME...] (those names pass ValidatePlugin but fail
// RegisterPlugin with "register failed by harness"; the line then carries
// that "error"). Runs until SIGTERM or SIGINT. klog writes to stderr.
package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/client-go/tools/record"
	"k8s.io/klog/v2"
	"k8s.io/kubernetes/pkg/kubelet/config"
	"k8s.io/kubernetes/pkg/kubelet/pluginmanager"
)

// rejectedError is the error ValidatePlugin returns for rejected names.
const rejectedError = "rejected by harness"

// registerError is the error RegisterPlugin returns for --fail-register names.
const registerError = "register failed by harness"

// eventLine is one JSON line on stdout.
type eventLine struct {
	Event    string   `json:"event"`
	Type     string   `json:"type,omitempty"`
	Name     string   `json:"name,omitempty"`
	Endpoint *string  `json:"endpoint,omitempty"`
	Versions []string `json:"versions,omitempty"`
	Error    string   `json:"error,omitempty"`
	TsNs     int64    `json:"ts_ns"`
}

// emitter serialises lines onto stdout; each line is written with a single
// write call (stdout is unbuffered in Go), so it is flushed at once.
type emitter struct {
	mu sync.Mutex
}

func (e *emitter) emit(l eventLine) {
	l.TsNs = time.Now().UnixNano()
	b, err := json.Marshal(l)
	if err != nil {
		fmt.Fprintf(os.Stderr, "harness: cannot encode event: %v\n", err)
		return
	}
	b = append(b, '\n')
	e.mu.Lock()
	defer e.mu.Unlock()
	if _, err := os.Stdout.Write(b); err != nil {
		fmt.Fprintf(os.Stderr, "harness: cannot write event: %v\n", err)
	}
}

// handler is a PluginHandler (1.20 interface) for one plugin type that
// accepts every plugin except the rejected names, and reports each call.
type handler struct {
	pluginType   string
	reject       map[string]bool
	failRegister map[string]bool
	out          *emitter
}

func strPtr(s string) *string { return &s }

func copyVersions(v []string) []string {
	out := make([]string, len(v))
	copy(out, v)
	return out
}

func (h *handler) ValidatePlugin(name string, endpoint string, versions []string) error {
	l := eventLine{Event: "validate", Type: h.pluginType, Name: name, Endpoint: strPtr(endpoint), Versions: copyVersions(versions)}
	var err error
	if h.reject[name] {
		err = errors.New(rejectedError)
		l.Error = rejectedError
	}
	h.out.emit(l)
	return err
}

func (h *handler) RegisterPlugin(name string, endpoint string, versions []string) error {
	l := eventLine{Event: "register", Type: h.pluginType, Name: name, Endpoint: strPtr(endpoint), Versions: copyVersions(versions)}
	var err error
	if h.failRegister[name] {
		err = errors.New(registerError)
		l.Error = registerError
	}
	h.out.emit(l)
	return err
}

func (h *handler) DeRegisterPlugin(name string) {
	h.out.emit(eventLine{Event: "deregister", Type: h.pluginType, Name: name, Endpoint: strPtr("")})
}

// nameSet splits a comma-separated list into a set.
func nameSet(list string) map[string]bool {
	set := map[string]bool{}
	for _, n := range strings.Split(list, ",") {
		if n = strings.TrimSpace(n); n != "" {
			set[n] = true
		}
	}
	return set
}

func main() {
	klog.InitFlags(nil)
	dir := flag.String("dir", "", "plugin registration directory to watch (created if missing)")
	reject := flag.String("reject", "", "comma-separated plugin names that fail ValidatePlugin")
	failRegister := flag.String("fail-register", "", "comma-separated plugin names that fail RegisterPlugin")
	flag.Parse()

	if *dir == "" {
		fmt.Fprintln(os.Stderr, "harness: --dir is required")
		os.Exit(2)
	}
	if err := os.MkdirAll(*dir, 0o755); err != nil {
		fmt.Fprintf(os.Stderr, "harness: cannot create %s: %v\n", *dir, err)
		os.Exit(1)
	}

	rejected := nameSet(*reject)
	failing := nameSet(*failRegister)

	out := &emitter{}
	// The fake recorder drops events when its buffer is full; none is needed here.
	recorder := record.NewFakeRecorder(1024)
	go func() {
		for range recorder.Events {
		}
	}()

	pm := pluginmanager.NewPluginManager(*dir, recorder)
	for _, t := range []string{"CSIPlugin", "DevicePlugin"} {
		pm.AddHandler(t, &handler{pluginType: t, reject: rejected, failRegister: failing, out: out})
	}

	sigCh := make(chan os.Signal, 1)
	signal.Notify(sigCh, syscall.SIGTERM, syscall.SIGINT)

	stopCh := make(chan struct{})
	done := make(chan struct{})
	sourcesReady := config.NewSourcesReady(func(sets.String) bool { return true })
	go func() {
		defer close(done)
		pm.Run(sourcesReady, stopCh)
	}()
	// Run starts the watcher synchronously: it adds the inotify watch and
	// then walks the directory, so a socket created at any time after this
	// point is found either by the walk or by an inotify event.
	out.emit(eventLine{Event: "ready"})

	<-sigCh
	close(stopCh)
	select {
	case <-done:
	case <-time.After(2 * time.Second):
	}
}
