package deploy_test

import (
	"encoding/json"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"

	"github.com/osmo-rl/osmo/internal/server"
)

// The parts of the Kubernetes objects the checks read, in their wire shape.
type (
	meta struct {
		Name        string            `json:"name"`
		Namespace   string            `json:"namespace"`
		Labels      map[string]string `json:"labels"`
		Annotations map[string]string `json:"annotations"`
	}
	object struct {
		APIVersion string            `json:"apiVersion"`
		Kind       string            `json:"kind"`
		Metadata   meta              `json:"metadata"`
		Spec       json.RawMessage   `json:"spec"`
		Data       map[string]string `json:"data"`
		StringData map[string]string `json:"stringData"`
	}
	labelSelector struct {
		MatchLabels map[string]string `json:"matchLabels"`
	}
	// deploymentSpec is a Deployment's spec, or a StatefulSet's: the
	// fields after Template are a StatefulSet's own.
	deploymentSpec struct {
		Replicas *int          `json:"replicas"`
		Selector labelSelector `json:"selector"`
		Template struct {
			Metadata meta    `json:"metadata"`
			Spec     podSpec `json:"spec"`
		} `json:"template"`
		ServiceName          string `json:"serviceName"`
		VolumeClaimTemplates []struct {
			Metadata meta `json:"metadata"`
			Spec     struct {
				AccessModes []string `json:"accessModes"`
				Resources   struct {
					Requests map[string]string `json:"requests"`
				} `json:"resources"`
			} `json:"spec"`
		} `json:"volumeClaimTemplates"`
	}
	podSpec struct {
		TerminationGracePeriodSeconds *int64           `json:"terminationGracePeriodSeconds"`
		SecurityContext               *securityContext `json:"securityContext"`
		Containers                    []container      `json:"containers"`
		Volumes                       []struct {
			Name      string `json:"name"`
			ConfigMap *struct {
				Name string `json:"name"`
			} `json:"configMap"`
			EmptyDir *struct{} `json:"emptyDir"`
			Secret   *struct {
				SecretName  string `json:"secretName"`
				DefaultMode *int   `json:"defaultMode"`
			} `json:"secret"`
		} `json:"volumes"`
		Affinity *struct {
			PodAntiAffinity *struct {
				Required  []podAffinityTerm `json:"requiredDuringSchedulingIgnoredDuringExecution"`
				Preferred []struct {
					PodAffinityTerm podAffinityTerm `json:"podAffinityTerm"`
				} `json:"preferredDuringSchedulingIgnoredDuringExecution"`
			} `json:"podAntiAffinity"`
		} `json:"affinity"`
	}
	podAffinityTerm struct {
		TopologyKey   string        `json:"topologyKey"`
		LabelSelector labelSelector `json:"labelSelector"`
	}
	securityContext struct {
		RunAsNonRoot             *bool  `json:"runAsNonRoot"`
		RunAsUser                *int64 `json:"runAsUser"`
		ReadOnlyRootFilesystem   *bool  `json:"readOnlyRootFilesystem"`
		AllowPrivilegeEscalation *bool  `json:"allowPrivilegeEscalation"`
		Capabilities             *struct {
			Drop []string `json:"drop"`
		} `json:"capabilities"`
	}
	container struct {
		Name    string   `json:"name"`
		Image   string   `json:"image"`
		Command []string `json:"command"`
		Args    []string `json:"args"`
		Env     []struct {
			Name      string `json:"name"`
			Value     string `json:"value"`
			ValueFrom *struct {
				FieldRef *struct {
					FieldPath string `json:"fieldPath"`
				} `json:"fieldRef"`
				SecretKeyRef     *keyRef `json:"secretKeyRef"`
				ConfigMapKeyRef  *keyRef `json:"configMapKeyRef"`
				ResourceFieldRef *struct {
					ContainerName string `json:"containerName"`
					Resource      string `json:"resource"`
					Divisor       string `json:"divisor"`
				} `json:"resourceFieldRef"`
			} `json:"valueFrom"`
		} `json:"env"`
		EnvFrom []struct {
			ConfigMapRef *struct {
				Name string `json:"name"`
			} `json:"configMapRef"`
			SecretRef *struct {
				Name string `json:"name"`
			} `json:"secretRef"`
		} `json:"envFrom"`
		Ports []struct {
			Name          string `json:"name"`
			ContainerPort int    `json:"containerPort"`
		} `json:"ports"`
		ReadinessProbe *probe `json:"readinessProbe"`
		LivenessProbe  *probe `json:"livenessProbe"`
		StartupProbe   *probe `json:"startupProbe"`
		Lifecycle      *struct {
			PreStop *struct {
				Sleep *struct {
					Seconds int64 `json:"seconds"`
				} `json:"sleep"`
				Exec *struct {
					Command []string `json:"command"`
				} `json:"exec"`
			} `json:"preStop"`
		} `json:"lifecycle"`
		Resources struct {
			Requests map[string]string `json:"requests"`
			Limits   map[string]string `json:"limits"`
		} `json:"resources"`
		SecurityContext *securityContext `json:"securityContext"`
		VolumeMounts    []struct {
			Name      string `json:"name"`
			MountPath string `json:"mountPath"`
		} `json:"volumeMounts"`
	}
	keyRef struct {
		Name string `json:"name"`
		Key  string `json:"key"`
	}
	probe struct {
		GRPC *struct {
			Port int `json:"port"`
		} `json:"grpc"`
		HTTPGet *struct {
			Path string          `json:"path"`
			Port json.RawMessage `json:"port"`
		} `json:"httpGet"`
		TCPSocket *struct {
			Port json.RawMessage `json:"port"`
		} `json:"tcpSocket"`
		Exec *struct {
			Command []string `json:"command"`
		} `json:"exec"`
	}
	serviceSpec struct {
		ClusterIP                string            `json:"clusterIP"`
		PublishNotReadyAddresses bool              `json:"publishNotReadyAddresses"`
		Selector                 map[string]string `json:"selector"`
		Ports                    []struct {
			Name       string          `json:"name"`
			Port       int             `json:"port"`
			TargetPort json.RawMessage `json:"targetPort"`
		} `json:"ports"`
	}
	hpaSpec struct {
		ScaleTargetRef struct {
			APIVersion string `json:"apiVersion"`
			Kind       string `json:"kind"`
			Name       string `json:"name"`
		} `json:"scaleTargetRef"`
		MinReplicas *int `json:"minReplicas"`
		MaxReplicas int  `json:"maxReplicas"`
		Metrics     []struct {
			Type     string `json:"type"`
			Resource *struct {
				Name string `json:"name"`
			} `json:"resource"`
		} `json:"metrics"`
	}
	networkPolicySpec struct {
		PodSelector labelSelector `json:"podSelector"`
		PolicyTypes []string      `json:"policyTypes"`
		Ingress     []struct {
			From []struct {
				PodSelector *labelSelector `json:"podSelector"`
			} `json:"from"`
			Ports []struct {
				Port json.RawMessage `json:"port"`
			} `json:"ports"`
		} `json:"ingress"`
	}
	pdbSpec struct {
		MinAvailable   json.RawMessage `json:"minAvailable"`
		MaxUnavailable json.RawMessage `json:"maxUnavailable"`
		Selector       labelSelector   `json:"selector"`
	}
)

// rendered is one overlay as kustomize builds it.
type rendered struct {
	overlay string
	// external are Secrets the overlay expects to exist in the cluster
	// without shipping them.
	external     map[string]bool
	objects      []object
	deployments  map[string]deploymentSpec
	statefulSets map[string]deploymentSpec
	services     map[string]serviceSpec
	hpas         map[string]hpaSpec
	pdbs         map[string]pdbSpec
	netpols      map[string]networkPolicySpec
	configMaps   map[string]map[string]string
	secrets      map[string]map[string]string
}

// render builds an overlay with kustomize's krusty, as `kubectl apply -k` does.
func render(t *testing.T, overlay string, externalSecrets ...string) *rendered {
	t.Helper()
	k := krusty.MakeKustomizer(krusty.MakeDefaultOptions())
	m, err := k.Run(filesys.MakeFsOnDisk(), overlay)
	if err != nil {
		t.Fatalf("kustomize build %s: %v", overlay, err)
	}
	r := &rendered{
		overlay:      overlay,
		external:     map[string]bool{},
		deployments:  map[string]deploymentSpec{},
		statefulSets: map[string]deploymentSpec{},
		services:     map[string]serviceSpec{},
		hpas:         map[string]hpaSpec{},
		pdbs:         map[string]pdbSpec{},
		netpols:      map[string]networkPolicySpec{},
		configMaps:   map[string]map[string]string{},
		secrets:      map[string]map[string]string{},
	}
	for _, name := range externalSecrets {
		r.external[name] = true
	}
	for _, res := range m.Resources() {
		b, err := res.MarshalJSON()
		if err != nil {
			t.Fatal(err)
		}
		var o object
		if err := json.Unmarshal(b, &o); err != nil {
			t.Fatalf("%s: %v", overlay, err)
		}
		r.objects = append(r.objects, o)
		name := o.Metadata.Name
		decode := func(v any) {
			if err := json.Unmarshal(o.Spec, v); err != nil {
				t.Fatalf("%s %s/%s: %v", overlay, o.Kind, name, err)
			}
		}
		switch o.Kind {
		case "Deployment":
			var d deploymentSpec
			decode(&d)
			r.deployments[name] = d
		case "StatefulSet":
			var d deploymentSpec
			decode(&d)
			r.statefulSets[name] = d
		case "Service":
			var s serviceSpec
			decode(&s)
			r.services[name] = s
		case "HorizontalPodAutoscaler":
			var h hpaSpec
			decode(&h)
			r.hpas[name] = h
		case "PodDisruptionBudget":
			var p pdbSpec
			decode(&p)
			r.pdbs[name] = p
		case "NetworkPolicy":
			var p networkPolicySpec
			decode(&p)
			r.netpols[name] = p
		case "ConfigMap":
			r.configMaps[name] = o.Data
		case "Secret":
			if r.external[name] {
				t.Errorf("%s ships Secret %s, which must come from outside the repository", overlay, name)
			}
			data := map[string]string{}
			for k, v := range o.Data {
				data[k] = v
			}
			for k, v := range o.StringData {
				data[k] = v
			}
			r.secrets[name] = data
		}
	}
	return r
}

// selects reports whether a non-empty selector matches labels.
func selects(selector, labels map[string]string) bool {
	if len(selector) == 0 {
		return false
	}
	for k, v := range selector {
		if labels[k] != v {
			return false
		}
	}
	return true
}

// workloads are the Deployments and StatefulSets, by "Kind/name".
func (r *rendered) workloads() map[string]deploymentSpec {
	w := map[string]deploymentSpec{}
	for name, d := range r.deployments {
		w["Deployment/"+name] = d
	}
	for name, d := range r.statefulSets {
		w["StatefulSet/"+name] = d
	}
	return w
}

// selectedWorkloads lists the workloads ("Kind/name") whose pods a selector
// matches.
func (r *rendered) selectedWorkloads(selector map[string]string) []string {
	var names []string
	for name, d := range r.workloads() {
		if selects(selector, d.Template.Metadata.Labels) {
			names = append(names, name)
		}
	}
	return names
}

// portOf resolves a port reference (a number or a port name, as JSON) in a
// container to its number.
func portOf(c container, ref json.RawMessage) (int, error) {
	var n int
	if err := json.Unmarshal(ref, &n); err == nil {
		for _, p := range c.Ports {
			if p.ContainerPort == n {
				return n, nil
			}
		}
		return 0, fmt.Errorf("container %s has no port %d", c.Name, n)
	}
	var name string
	if err := json.Unmarshal(ref, &name); err != nil {
		return 0, fmt.Errorf("port reference %s: %v", ref, err)
	}
	for _, p := range c.Ports {
		if p.Name == name {
			return p.ContainerPort, nil
		}
	}
	return 0, fmt.Errorf("container %s has no port named %q", c.Name, name)
}

func (c container) env(name string) (string, bool) {
	for _, e := range c.Env {
		if e.Name == name {
			return e.Value, true
		}
	}
	return "", false
}

// isOsmoImage reports whether a container runs the osmo image.
func isOsmoImage(image string) bool {
	name, _, _ := strings.Cut(image, ":")
	return name == "osmo" || strings.HasSuffix(name, "/osmo")
}

// dnsAddrRE is a gRPC target naming a headless Service in the pod's own
// namespace: dns:///NAME.$(POD_NAMESPACE).svc.cluster.local:PORT.
var dnsAddrRE = regexp.MustCompile(`^dns:///([a-z0-9-]+)\.\$\(POD_NAMESPACE\)\.svc\.cluster\.local:(\d+)$`)

// TestKustomizeOverlays renders overlays/dev and overlays/prod with
// kustomize and checks that the objects refer to one another correctly and
// that every osmo container runs a command the binary accepts.
func TestKustomizeOverlays(t *testing.T) {
	for _, tc := range []struct {
		overlay   string
		namespace string
		dev       bool
		external  []string // Secrets created outside the repository
	}{
		{"overlays/dev", "osmo-dev", true, nil},
		{"overlays/prod", "osmo", false, []string{"osmo-api-key"}},
	} {
		t.Run(tc.overlay, func(t *testing.T) {
			r := render(t, tc.overlay, tc.external...)
			checkObjects(t, r, tc.namespace)
			checkServices(t, r)
			checkContainers(t, r)
			checkScaling(t, r, tc.dev)
			checkTelemetry(t, r, tc.dev)
			checkNATS(t, r, tc.dev)
			checkSharedState(t, r)
			checkNATSNetworkPolicy(t, r)
		})
	}
}

func checkObjects(t *testing.T, r *rendered, namespace string) {
	t.Run("names unique and namespaced", func(t *testing.T) {
		seen := map[string]bool{}
		hasNamespace := false
		for _, o := range r.objects {
			key := o.Kind + "/" + o.Metadata.Namespace + "/" + o.Metadata.Name
			if seen[key] {
				t.Errorf("%s twice", key)
			}
			seen[key] = true
			if o.Kind == "Namespace" {
				hasNamespace = o.Metadata.Name == namespace
				continue
			}
			if o.Metadata.Namespace != namespace {
				t.Errorf("%s/%s in namespace %q, want %q", o.Kind, o.Metadata.Name, o.Metadata.Namespace, namespace)
			}
		}
		if !hasNamespace {
			t.Errorf("no Namespace %s", namespace)
		}
		for _, want := range []string{"gateway", "rollout", "grader"} {
			if _, ok := r.deployments[want]; !ok {
				t.Errorf("no Deployment %s", want)
			}
			if _, ok := r.services[want]; !ok {
				t.Errorf("no Service %s", want)
			}
		}
	})
}

func checkServices(t *testing.T, r *rendered) {
	t.Run("services select one workload and its ports", func(t *testing.T) {
		for name, s := range r.services {
			deps := r.selectedWorkloads(s.Selector)
			if len(deps) != 1 {
				t.Errorf("Service %s selects %v, want exactly one Deployment or StatefulSet", name, deps)
				continue
			}
			c := r.workloads()[deps[0]].Template.Spec.Containers[0]
			for _, p := range s.Ports {
				n, err := portOf(c, p.TargetPort)
				if err != nil {
					t.Errorf("Service %s port %s: %v", name, p.Name, err)
					continue
				}
				// Clients of a headless Service dial pod IPs directly, on
				// the Service's port number.
				if s.ClusterIP == "None" && n != p.Port {
					t.Errorf("headless Service %s: port %d targets %d; clients would dial %d", name, p.Port, n, p.Port)
				}
			}
		}
		for _, name := range []string{"grader", "rollout"} {
			if r.services[name].ClusterIP != "None" {
				t.Errorf("Service %s: clusterIP %q, want None (headless, so dns:/// clients balance over pods)", name, r.services[name].ClusterIP)
			}
		}
	})

	t.Run("gRPC addresses name headless services in the pod's namespace", func(t *testing.T) {
		want := map[string]map[string]string{
			"rollout": {"grader-addr": "grader:9091"},
			"gateway": {"rollout-addr": "rollout:9090", "grader-addr": "grader:9091"},
		}
		for dep, flags := range want {
			c := r.deployments[dep].Template.Spec.Containers[0]
			cl, err := parseCmdline(c.Args, helpOf(t, c.Args[0]))
			if err != nil {
				t.Fatalf("Deployment %s: %v", dep, err)
			}
			for flag, target := range flags {
				v, _ := cl.last(flag)
				m := dnsAddrRE.FindStringSubmatch(v)
				if m == nil || m[1]+":"+m[2] != target {
					t.Errorf("Deployment %s --%s=%q, want dns:///%s.$(POD_NAMESPACE).svc.cluster.local:%s", dep, flag, v, strings.Split(target, ":")[0], strings.Split(target, ":")[1])
					continue
				}
				svc, ok := r.services[m[1]]
				if !ok || svc.ClusterIP != "None" {
					t.Errorf("Deployment %s --%s names Service %s, which is missing or not headless", dep, flag, m[1])
					continue
				}
				port, _ := strconv.Atoi(m[2])
				found := false
				for _, p := range svc.Ports {
					found = found || p.Port == port
				}
				if !found {
					t.Errorf("Deployment %s --%s: Service %s has no port %d", dep, flag, m[1], port)
				}
				ns := false
				for _, e := range c.Env {
					ns = ns || (e.Name == "POD_NAMESPACE" && e.ValueFrom != nil && e.ValueFrom.FieldRef != nil && e.ValueFrom.FieldRef.FieldPath == "metadata.namespace")
				}
				if !ns {
					t.Errorf("Deployment %s uses $(POD_NAMESPACE) without the downward-API env var", dep)
				}
			}
		}
	})
}

func checkContainers(t *testing.T, r *rendered) {
	t.Run("containers", func(t *testing.T) {
		for dep, d := range r.workloads() {
			ps := d.Template.Spec
			if len(ps.Containers) == 0 {
				t.Errorf("%s has no containers", dep)
				continue
			}
			if !selects(d.Selector.MatchLabels, d.Template.Metadata.Labels) {
				t.Errorf("%s: selector %v does not match its pods %v", dep, d.Selector.MatchLabels, d.Template.Metadata.Labels)
			}
			volumes := map[string]bool{}
			for _, v := range ps.Volumes {
				volumes[v.Name] = true
			}
			for _, v := range d.VolumeClaimTemplates {
				volumes[v.Metadata.Name] = true
			}
			for _, c := range ps.Containers {
				where := fmt.Sprintf("%s container %s", dep, c.Name)
				checkSecurity(t, where, ps.SecurityContext, c.SecurityContext)
				for _, q := range []string{"cpu", "memory"} {
					if c.Resources.Requests[q] == "" || c.Resources.Limits[q] == "" {
						t.Errorf("%s: no %s request and limit", where, q)
					}
				}
				if tag := c.Image[strings.LastIndex(c.Image, ":")+1:]; !strings.Contains(c.Image, ":") || tag == "latest" {
					t.Errorf("%s: image %q has no pinned tag", where, c.Image)
				}
				for _, m := range c.VolumeMounts {
					if !volumes[m.Name] {
						t.Errorf("%s mounts unknown volume %s", where, m.Name)
					}
				}
				for kind, p := range map[string]*probe{"readiness": c.ReadinessProbe, "liveness": c.LivenessProbe, "startup": c.StartupProbe} {
					if p == nil {
						if kind != "startup" {
							t.Errorf("%s: no %s probe", where, kind)
						}
						continue
					}
					var err error
					switch {
					case p.GRPC != nil:
						_, err = portOf(c, json.RawMessage(strconv.Itoa(p.GRPC.Port)))
					case p.HTTPGet != nil:
						_, err = portOf(c, p.HTTPGet.Port)
					case p.TCPSocket != nil:
						_, err = portOf(c, p.TCPSocket.Port)
					case p.Exec != nil:
						err = checkHealthProbe(c, p.Exec.Command)
					default:
						err = fmt.Errorf("no grpc, httpGet, tcpSocket or exec handler")
					}
					if err != nil {
						t.Errorf("%s: %s probe: %v", where, kind, err)
					}
				}
				checkEnvRefs(t, r, where, c)
				if isOsmoImage(c.Image) {
					checkOsmoContainer(t, where, d, c)
				}
			}
		}
	})
}

func checkSecurity(t *testing.T, where string, pod, c *securityContext) {
	t.Helper()
	nonRoot := false
	for _, sc := range []*securityContext{pod, c} {
		if sc != nil && ((sc.RunAsNonRoot != nil && *sc.RunAsNonRoot) || (sc.RunAsUser != nil && *sc.RunAsUser > 0)) {
			nonRoot = true
		}
		if sc != nil && sc.RunAsUser != nil && *sc.RunAsUser == 0 {
			t.Errorf("%s: runAsUser 0", where)
		}
	}
	if !nonRoot {
		t.Errorf("%s: not forced to run as non-root", where)
	}
	if c == nil || c.ReadOnlyRootFilesystem == nil || !*c.ReadOnlyRootFilesystem {
		t.Errorf("%s: root filesystem is writable", where)
	}
	if c == nil || c.AllowPrivilegeEscalation == nil || *c.AllowPrivilegeEscalation {
		t.Errorf("%s: privilege escalation allowed", where)
	}
	if c == nil || c.Capabilities == nil || len(c.Capabilities.Drop) != 1 || c.Capabilities.Drop[0] != "ALL" {
		t.Errorf("%s: capabilities not dropped", where)
	}
}

// checkMemoryLimit checks that an osmo container gives the Go collector its
// memory limit as GOMEMLIMIT: without a soft limit the collector paces the
// heap by GOGC alone, and it could outgrow the container's.
func checkMemoryLimit(t *testing.T, where string, c container) {
	t.Helper()
	if c.Resources.Limits["memory"] == "" {
		t.Errorf("%s: no memory limit to derive GOMEMLIMIT from", where)
	}
	for _, e := range c.Env {
		if e.Name != "GOMEMLIMIT" {
			continue
		}
		ref := e.ValueFrom
		if ref == nil || ref.ResourceFieldRef == nil || ref.ResourceFieldRef.Resource != "limits.memory" ||
			(ref.ResourceFieldRef.ContainerName != "" && ref.ResourceFieldRef.ContainerName != c.Name) ||
			(ref.ResourceFieldRef.Divisor != "" && ref.ResourceFieldRef.Divisor != "1") {
			t.Errorf("%s: GOMEMLIMIT must be the container's own limits.memory in bytes (resourceFieldRef, divisor 1): %+v", where, e)
		}
		return
	}
	t.Errorf("%s: GOMEMLIMIT is not set from the container's memory limit", where)
}

// checkEnvRefs checks that every ConfigMap and Secret a container reads
// exists, with the keys it reads.
func checkEnvRefs(t *testing.T, r *rendered, where string, c container) {
	t.Helper()
	for _, ef := range c.EnvFrom {
		if ef.ConfigMapRef != nil {
			if _, ok := r.configMaps[ef.ConfigMapRef.Name]; !ok {
				t.Errorf("%s: envFrom ConfigMap %s does not exist", where, ef.ConfigMapRef.Name)
			}
		}
		if ef.SecretRef != nil {
			if _, ok := r.secrets[ef.SecretRef.Name]; !ok && !r.external[ef.SecretRef.Name] {
				t.Errorf("%s: envFrom Secret %s does not exist", where, ef.SecretRef.Name)
			}
		}
	}
	for _, e := range c.Env {
		if e.ValueFrom == nil {
			continue
		}
		if ref := e.ValueFrom.SecretKeyRef; ref != nil {
			if _, ok := r.secrets[ref.Name][ref.Key]; !ok && !r.external[ref.Name] {
				t.Errorf("%s: env %s reads Secret %s key %s, which does not exist", where, e.Name, ref.Name, ref.Key)
			}
		}
		if ref := e.ValueFrom.ConfigMapKeyRef; ref != nil {
			if _, ok := r.configMaps[ref.Name][ref.Key]; !ok {
				t.Errorf("%s: env %s reads ConfigMap %s key %s, which does not exist", where, e.Name, ref.Name, ref.Key)
			}
		}
	}
}

// checkOsmoContainer checks an osmo container's command line against the
// binary and the pod around it: ports, metrics annotations, shutdown grace.
func checkOsmoContainer(t *testing.T, where string, d deploymentSpec, c container) {
	t.Helper()
	if len(c.Command) != 1 || c.Command[0] != "/osmo" || len(c.Args) == 0 {
		t.Errorf("%s: command %q args %q, want [/osmo] and the subcommand first in args", where, c.Command, c.Args)
		return
	}
	cl, err := parseCmdline(c.Args, helpOf(t, c.Args[0]))
	if err != nil {
		t.Errorf("%s: %v", where, err)
		return
	}
	ports, err := listenPorts(cl)
	if err != nil {
		t.Errorf("%s: %v", where, err)
	}
	declared := map[int]bool{}
	for _, p := range c.Ports {
		declared[p.ContainerPort] = true
	}
	for flag, port := range ports {
		if !declared[port] {
			t.Errorf("%s listens on %d (--%s) without a containerPort", where, port, flag)
		}
	}
	h := helpOf(t, cl.sub)
	for _, f := range []string{"addr", "grpc-addr", "metrics-addr"} {
		if _, has := h.flags[f]; has {
			if _, set := cl.last(f); !set {
				t.Errorf("%s: osmo %s listens by --%s; set it explicitly so the ports above are all of them", where, cl.sub, f)
			}
		}
	}
	checkMemoryLimit(t, where, c)
	ann := d.Template.Metadata.Annotations
	if ann["prometheus.io/scrape"] != "true" {
		t.Errorf("%s: pod not annotated for Prometheus scraping", where)
	}
	metricsPort := 0
	if p, ok := ports["metrics-addr"]; ok {
		metricsPort = p
	} else if p, ok := ports["addr"]; ok {
		metricsPort = p // HTTP services serve /metrics on their own port
	}
	if ann["prometheus.io/port"] != strconv.Itoa(metricsPort) || ann["prometheus.io/path"] != "/metrics" {
		t.Errorf("%s: scrape annotations %s:%s, want port %d path /metrics", where, ann["prometheus.io/port"], ann["prometheus.io/path"], metricsPort)
	}
	// SIGKILL must wait for the preStop hook, the drain (the rollouts, then
	// their callbacks: twice --drain-timeout) and the servers' graceful stop.
	need := 2*drainTimeout(t, cl) + server.ShutdownTimeout
	if c.Lifecycle != nil && c.Lifecycle.PreStop != nil && c.Lifecycle.PreStop.Sleep != nil {
		need += time.Duration(c.Lifecycle.PreStop.Sleep.Seconds) * time.Second
	}
	grace := 30 * time.Second // Kubernetes' default
	if g := d.Template.Spec.TerminationGracePeriodSeconds; g != nil {
		grace = time.Duration(*g) * time.Second
	}
	if grace <= need {
		t.Errorf("%s: terminationGracePeriodSeconds %v, want more than %v (preStop + --drain-timeout + graceful stop)", where, grace, need)
	}
}

func checkScaling(t *testing.T, r *rendered, dev bool) {
	t.Run("replicas, autoscalers and disruption budgets", func(t *testing.T) {
		for name, h := range r.hpas {
			ref := h.ScaleTargetRef
			d, ok := r.deployments[ref.Name]
			if ref.Kind != "Deployment" || ref.APIVersion != "apps/v1" || !ok {
				t.Errorf("HPA %s targets %s %s/%s, which does not exist", name, ref.APIVersion, ref.Kind, ref.Name)
				continue
			}
			if h.MinReplicas == nil || *h.MinReplicas < 1 || *h.MinReplicas > h.MaxReplicas {
				t.Errorf("HPA %s: bounds %v..%d", name, h.MinReplicas, h.MaxReplicas)
			}
			for _, m := range h.Metrics {
				if m.Type == "Resource" && m.Resource != nil {
					for _, c := range d.Template.Spec.Containers {
						if c.Resources.Requests[m.Resource.Name] == "" {
							t.Errorf("HPA %s scales on %s, which container %s does not request", name, m.Resource.Name, c.Name)
						}
					}
				}
			}
			if d.Replicas != nil {
				t.Errorf("Deployment %s sets replicas although HPA %s owns the count", ref.Name, name)
			}
		}
		if dev {
			if len(r.hpas) != 0 {
				t.Errorf("dev has autoscalers %v", r.hpas)
			}
			for name, d := range r.deployments {
				if d.Replicas == nil || *d.Replicas != 1 {
					t.Errorf("dev Deployment %s: replicas %v, want 1", name, d.Replicas)
				}
			}
			for _, want := range []string{"mockllm", "jaeger"} {
				if _, ok := r.deployments[want]; !ok {
					t.Errorf("dev has no %s Deployment", want)
				}
			}
		} else {
			for _, name := range []string{"rollout", "grader"} {
				h, ok := r.hpas[name]
				if !ok || h.ScaleTargetRef.Name != name || *h.MinReplicas < 2 {
					t.Errorf("prod: HPA %s missing or below 2 replicas", name)
				}
			}
			if gw := r.deployments["gateway"]; gw.Replicas == nil || *gw.Replicas < 2 {
				t.Errorf("prod: gateway replicas %v, want at least 2", gw.Replicas)
			}
			for _, name := range []string{"mockllm", "jaeger"} {
				if _, ok := r.deployments[name]; ok {
					t.Errorf("prod deploys the development-only %s", name)
				}
			}
		}
		covered := map[string]bool{}
		for pdbName, p := range r.pdbs {
			deps := r.selectedWorkloads(p.Selector.MatchLabels)
			if len(deps) != 1 {
				t.Errorf("PDB %s selects %v, want exactly one Deployment or StatefulSet", pdbName, deps)
				continue
			}
			if len(p.MinAvailable) != 0 || len(p.MaxUnavailable) == 0 {
				t.Errorf("PDB %s: want maxUnavailable (minAvailable blocks every drain of a single replica)", pdbName)
			}
			// For NATS, one: two of three nodes, a JetStream quorum, stay.
			if deps[0] == "StatefulSet/nats" && string(p.MaxUnavailable) != "1" {
				t.Errorf("PDB %s: maxUnavailable %s, want 1 (a quorum of NATS nodes stays up)", pdbName, p.MaxUnavailable)
			}
			covered[deps[0]] = true
		}
		for _, name := range []string{"Deployment/gateway", "Deployment/rollout", "Deployment/grader", "StatefulSet/nats"} {
			if !covered[name] {
				t.Errorf("no PodDisruptionBudget for %s", name)
			}
		}
	})
}

func checkTelemetry(t *testing.T, r *rendered, dev bool) {
	t.Run("OpenTelemetry settings", func(t *testing.T) {
		names := map[string]string{}
		for dep, d := range r.deployments {
			c := d.Template.Spec.Containers[0]
			if !isOsmoImage(c.Image) {
				continue
			}
			settings := map[string]string{}
			for _, ef := range c.EnvFrom {
				if ef.ConfigMapRef != nil {
					for k, v := range r.configMaps[ef.ConfigMapRef.Name] {
						settings[k] = v
					}
				}
			}
			endpoint, protocol := settings["OTEL_EXPORTER_OTLP_ENDPOINT"], settings["OTEL_EXPORTER_OTLP_PROTOCOL"]
			m := regexp.MustCompile(`^http://([a-z0-9.-]+):(\d+)$`).FindStringSubmatch(endpoint)
			if m == nil {
				t.Errorf("Deployment %s: OTEL_EXPORTER_OTLP_ENDPOINT=%q, want http://HOST:PORT", dep, endpoint)
				continue
			}
			if want := map[string]string{"grpc": "4317", "http/protobuf": "4318"}[protocol]; m[2] != want {
				t.Errorf("Deployment %s: OTLP endpoint port %s with protocol %q", dep, m[2], protocol)
			}
			if dev {
				svc, ok := r.services[m[1]]
				found := false
				for _, p := range svc.Ports {
					found = found || strconv.Itoa(p.Port) == m[2]
				}
				if !ok || !found {
					t.Errorf("Deployment %s: OTLP endpoint %s is no Service port in the overlay", dep, endpoint)
				}
			}
			name, _ := c.env("OTEL_SERVICE_NAME")
			if !strings.HasPrefix(name, "osmo-") {
				t.Errorf("Deployment %s: OTEL_SERVICE_NAME=%q", dep, name)
			}
			if prev, dup := names[name]; dup {
				t.Errorf("Deployments %s and %s share OTEL_SERVICE_NAME %q", prev, dep, name)
			}
			names[name] = dep
		}
	})
}

// TestKustomizeSecretIsAPlaceholder keeps real keys out of the repository:
// the base ships a development placeholder, which prod does not apply.
func TestKustomizeSecretIsAPlaceholder(t *testing.T) {
	for _, overlay := range []string{"base", "overlays/dev"} {
		r := render(t, overlay)
		key, ok := r.secrets["osmo-api-key"]["OSMO_API_KEY"]
		if !ok || !strings.HasPrefix(key, "replace-me") {
			t.Errorf("%s: Secret osmo-api-key holds %q; commit only the placeholder", overlay, key)
		}
	}
}
