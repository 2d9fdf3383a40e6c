// This file is plugreg's own code. interop/build-peers.sh copies it into the
// Kubernetes v1.20 source tree at pkg/kubelet/pluginmanager/pluginwatcher so
// that plugreg's example-plugin wrapper can drain the example plugin's
// registration status channel, which upstream keeps unexported.

package pluginwatcher

import registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

// PlugregRegistrationStatus returns the channel into which the example
// plugin's NotifyRegistrationStatus handler writes every status it receives.
// The channel is unbuffered: whoever runs the plugin must drain it.
func PlugregRegistrationStatus(p *examplePlugin) <-chan registerapi.RegistrationStatus {
	return p.registrationStatus
}
