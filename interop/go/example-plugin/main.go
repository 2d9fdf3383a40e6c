// Command plugreg-example-plugin runs the real Kubernetes v1.20 example
// plugin (pluginwatcher.NewTestExamplePlugin from
// k8s.io/kubernetes/pkg/kubelet/pluginmanager/pluginwatcher) on a
// registration socket, so that plugreg's plugin manager can be tested
// against a plugin side nobody here wrote.
//
// It is plugreg's own code. interop/build-peers.sh copies it into the
// Kubernetes source tree at cmd/plugreg-example-plugin, together with a small
// exporting file in the pluginwatcher package (interop/go/pluginwatcher-shim)
// that gives access to the plugin's unbuffered registration status channel.
//
// Output (one object per line on stdout):
//
//	{"event":"ready","ts_ns":N}                                  after Serve
//	{"event":"notify","registered":true,"error":"","ts_ns":N}     per NotifyRegistrationStatus
//	{"event":"stopped","ts_ns":N}                                 after Stop on SIGTERM/SIGINT
//
// Flags: --socket PATH, --name NAME, --type TYPE, --versions v1beta1,v1beta2
// (advertised in GetInfo and served). The upstream example plugin advertises
// its socket path as its endpoint and serves the example services there.
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	"k8s.io/klog/v2"
	"k8s.io/kubernetes/pkg/kubelet/pluginmanager/pluginwatcher"
)

type eventLine struct {
	Event      string  `json:"event"`
	Registered *bool   `json:"registered,omitempty"`
	Error      *string `json:"error,omitempty"`
	Message    string  `json:"message,omitempty"`
	TsNs       int64   `json:"ts_ns"`
}

var outMu sync.Mutex

func emit(l eventLine) {
	l.TsNs = time.Now().UnixNano()
	b, err := json.Marshal(l)
	if err != nil {
		fmt.Fprintf(os.Stderr, "example-plugin: cannot encode event: %v\n", err)
		return
	}
	b = append(b, '\n')
	outMu.Lock()
	defer outMu.Unlock()
	if _, err := os.Stdout.Write(b); err != nil {
		fmt.Fprintf(os.Stderr, "example-plugin: cannot write event: %v\n", err)
	}
}

func main() {
	klog.InitFlags(nil)
	socket := flag.String("socket", "", "registration socket path to listen on")
	name := flag.String("name", "", "plugin name reported by GetInfo")
	pluginType := flag.String("type", "DevicePlugin", "plugin type reported by GetInfo")
	versions := flag.String("versions", "v1beta1,v1beta2", "comma-separated versions advertised and served")
	flag.Parse()

	if *socket == "" || *name == "" {
		fmt.Fprintln(os.Stderr, "example-plugin: --socket and --name are required")
		os.Exit(2)
	}
	var vers []string
	for _, v := range strings.Split(*versions, ",") {
		if v = strings.TrimSpace(v); v != "" {
			vers = append(vers, v)
		}
	}
	sigCh := make(chan os.Signal, 1)
	signal.Notify(sigCh, syscall.SIGTERM, syscall.SIGINT)

	p := pluginwatcher.NewTestExamplePlugin(*name, *pluginType, *socket, vers...)
	statusCh := pluginwatcher.PlugregRegistrationStatus(p)
	go func() {
		for st := range statusCh {
			registered := st.PluginRegistered
			errStr := st.Error
			emit(eventLine{Event: "notify", Registered: &registered, Error: &errStr})
		}
	}()

	if err := p.Serve(vers...); err != nil {
		fmt.Fprintf(os.Stderr, "example-plugin: serve: %v\n", err)
		os.Exit(1)
	}
	emit(eventLine{Event: "ready"})

	<-sigCh
	if err := p.Stop(); err != nil {
		emit(eventLine{Event: "stopped", Message: err.Error()})
		os.Exit(1)
	}
	emit(eventLine{Event: "stopped"})
}
