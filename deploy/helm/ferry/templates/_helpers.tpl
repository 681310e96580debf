{{/* The release's base name. */}}
{{- define "ferry.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Labels of every object; pass (dict "ctx" $ "component" "router"). */}}
{{- define "ferry.labels" -}}
app.kubernetes.io/name: ferry
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/component: {{ .component }}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version }}
{{- end -}}

{{- define "ferry.selector" -}}
app.kubernetes.io/name: ferry
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* The image of a component; pass (dict "ctx" $ "gpu" bool). */}}
{{- define "ferry.image" -}}
{{- $tag := .ctx.Values.image.tag | default .ctx.Chart.AppVersion -}}
{{- if .gpu -}}
{{ .ctx.Values.image.gpuRepository }}:{{ $tag }}
{{- else -}}
{{ .ctx.Values.image.repository }}:{{ $tag }}
{{- end -}}
{{- end -}}

{{/* etcd client endpoints. */}}
{{- define "ferry.etcd" -}}
{{- if .Values.etcd.enabled -}}
{{ include "ferry.fullname" . }}-etcd:2379
{{- else -}}
{{ .Values.etcd.external }}
{{- end -}}
{{- end -}}

{{/* The container security context every Ferry container gets. */}}
{{- define "ferry.securityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: ["ALL"]
{{- if .rdma }}
  # Registering (pinning) the KV pool for RDMA needs IPC_LOCK.
  add: ["IPC_LOCK"]
{{- end }}
{{- end -}}

{{/* The model volume's source. */}}
{{- define "ferry.modelVolume" -}}
{{- if .Values.model.volume -}}
{{ toYaml .Values.model.volume }}
{{- else -}}
persistentVolumeClaim:
  claimName: {{ .Values.model.claimName }}
  readOnly: true
{{- end -}}
{{- end -}}

{{/* The Secret holding a role's internal certificate; pass (dict "ctx" $ "role" "router"). */}}
{{- define "ferry.internalTlsSecret" -}}
{{- if eq .ctx.Values.internalTls.mode "secrets" -}}
{{ get .ctx.Values.internalTls.secrets .role }}
{{- else -}}
{{ include "ferry.fullname" .ctx }}-internal-tls-{{ .role }}
{{- end -}}
{{- end -}}

{{/* Mutual TLS flags (container args), or --insecure-internal; pass (dict "ctx" $ "role" r). */}}
{{- define "ferry.internalTlsArgs" -}}
{{- if eq .ctx.Values.internalTls.mode "insecure" }}
- --insecure-internal
{{- else }}
- --internal-tls-cert=/internal-tls/tls.crt
- --internal-tls-key=/internal-tls/tls.key
- --internal-tls-ca=/internal-tls/ca.crt
- --internal-tls-server-name={{ .ctx.Values.internalTls.serverName }}
{{- end }}
{{- end -}}

{{/* The mutual TLS volume mount and volume; pass (dict "ctx" $ "role" r). */}}
{{- define "ferry.internalTlsMount" -}}
{{- if ne .ctx.Values.internalTls.mode "insecure" }}
- {name: internal-tls, mountPath: /internal-tls, readOnly: true}
{{- end }}
{{- end -}}
{{- define "ferry.internalTlsVolume" -}}
{{- if ne .ctx.Values.internalTls.mode "insecure" }}
- name: internal-tls
  secret: {secretName: {{ include "ferry.internalTlsSecret" . }}}
{{- end }}
{{- end -}}

{{/* etcd TLS and auth flags for a Ferry daemon (container args). */}}
{{- define "ferry.etcdArgs" -}}
{{- $e := .Values.etcd -}}
- --etcd={{ include "ferry.etcd" . }}
- --cluster={{ .Values.cluster }}
{{- if $e.tls.enabled }}
- --etcd-ca=/etcd-tls/ca.crt
- --etcd-cert=/etcd-tls/tls.crt
- --etcd-key=/etcd-tls/tls.key
{{- end }}
{{- if $e.auth.user }}
- --etcd-user={{ $e.auth.user }}
- --etcd-password-file=/etcd-auth/password
{{- end }}
{{- end -}}

{{/* The Secret with etcd's CA and Ferry's client certificate (ca.crt, tls.crt, tls.key). */}}
{{- define "ferry.etcdClientSecret" -}}
{{- .Values.etcd.tls.secret | default (printf "%s-etcd-client" (include "ferry.fullname" .)) -}}
{{- end -}}

{{/* etcd TLS and auth volume mounts and volumes of a Ferry daemon. */}}
{{- define "ferry.etcdMounts" -}}
{{- if .Values.etcd.tls.enabled }}
- {name: etcd-tls, mountPath: /etcd-tls, readOnly: true}
{{- end }}
{{- if .Values.etcd.auth.user }}
- {name: etcd-auth, mountPath: /etcd-auth, readOnly: true}
{{- end }}
{{- end -}}
{{- define "ferry.etcdVolumes" -}}
{{- if .Values.etcd.tls.enabled }}
- name: etcd-tls
  secret: {secretName: {{ include "ferry.etcdClientSecret" . }}}
{{- end }}
{{- if .Values.etcd.auth.user }}
- name: etcd-auth
  secret: {secretName: {{ .Values.etcd.auth.passwordSecret }}}
{{- end }}
{{- end -}}

{{/* NetworkPolicy peers: pods of `components`, and networkPolicy.nodeCIDRs when `nodes` (where a hostNetwork worker may call from); pass (dict "ctx" $ "components" (list ...) "nodes" bool). */}}
{{- define "ferry.peers" -}}
{{- range $c := .components }}
- podSelector:
    matchLabels:
      {{- include "ferry.selector" (dict "ctx" $.ctx "component" $c) | nindent 6 }}
{{- end }}
{{- if .nodes }}
{{- range $cidr := $.ctx.Values.networkPolicy.nodeCIDRs }}
- ipBlock: {cidr: {{ $cidr | quote }}}
{{- end }}
{{- end }}
{{- end -}}

{{/* "kept" when all three generated internal TLS Secrets are in the cluster, made for the
current internalTls.serverName (Secrets without the annotation predate it: taken as made for
the current name); else empty, and internal-tls.yaml makes them anew with a new CA. */}}
{{- define "ferry.internalTlsKept" -}}
{{- $t := .Values.internalTls -}}
{{- $base := printf "%s-internal-tls" (include "ferry.fullname" .) -}}
{{- $complete := true -}}
{{- range $r := list "router" "prefill" "decode" -}}
{{- $s := lookup "v1" "Secret" $.Release.Namespace (printf "%s-%s" $base $r) -}}
{{- if not (and $s $s.data (eq (dig "metadata" "annotations" "ferry.dev/server-name" $t.serverName ($s | default dict)) $t.serverName)) -}}
{{- $complete = false -}}
{{- end -}}
{{- end -}}
{{- if $complete -}}kept{{- end -}}
{{- end -}}

{{/* A pod template annotation that changes with the internal CA, so that a new CA restarts
every pod (a daemon reads its certificates at start only): the kept CA's digest, or, when
this release makes a new CA (and offline, where nothing can be looked up), a fresh value.
With mode `secrets` the digest of the router Secret's CA, when it can be read. Empty when
internal TLS is off. */}}
{{- define "ferry.internalCaChecksum" -}}
{{- $mode := .Values.internalTls.mode -}}
{{- if eq $mode "generate" -}}
{{- if eq (include "ferry.internalTlsKept" .) "kept" -}}
{{- $s := lookup "v1" "Secret" .Release.Namespace (printf "%s-internal-tls-router" (include "ferry.fullname" .)) -}}
{{- index $s.data "ca.crt" | sha256sum -}}
{{- else -}}
new-{{ randAlphaNum 16 | lower }}
{{- end -}}
{{- else if eq $mode "secrets" -}}
{{- $s := lookup "v1" "Secret" .Release.Namespace (get .Values.internalTls.secrets "router") -}}
{{- with $s }}{{ with .data }}{{ index . "ca.crt" | default "" | sha256sum }}{{ end }}{{ end -}}
{{- end -}}
{{- end -}}
