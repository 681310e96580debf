{{/* A worker Deployment; pass (dict "ctx" $ "role" "prefill" "w" .Values.prefill). */}}
{{- define "ferry.worker" -}}
{{- $ := .ctx -}}
{{- $w := .w -}}
{{- $name := printf "%s-%s" (include "ferry.fullname" $) .role -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ $name }}
  labels:
    {{- include "ferry.labels" (dict "ctx" $ "component" .role) | nindent 4 }}
spec:
  replicas: {{ $w.replicas }}
  selector:
    matchLabels:
      {{- include "ferry.selector" (dict "ctx" $ "component" .role) | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "ferry.selector" (dict "ctx" $ "component" .role) | nindent 8 }}
      {{- with include "ferry.internalCaChecksum" $ }}
      annotations:
        # A new internal CA restarts the pod: its daemon reads certificates at start only.
        ferry.dev/internal-ca: {{ . | quote }}
      {{- end }}
    spec:
      {{- with $.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        {{- toYaml $.Values.podSecurityContext | nindent 8 }}
      {{- if $w.hostNetwork }}
      hostNetwork: true
      dnsPolicy: ClusterFirstWithHostNet
      {{- end }}
      # Time to finish requests in flight and free every page (a decode pod: its drain grace
      # too). No preStop hook: on SIGTERM the worker itself reports NOT_SERVING and leaves
      # etcd at once, which is how routers stop placing on it.
      terminationGracePeriodSeconds: {{ if eq .role "decode" }}{{ add 50 $w.drainGrace }}{{ else }}60{{ end }}
      containers:
        - name: {{ .role }}
          image: {{ include "ferry.image" (dict "ctx" $ "gpu" $w.gpu.enabled) | quote }}
          imagePullPolicy: {{ $.Values.image.pullPolicy }}
          command: ["ferry"]
          args:
            - {{ .role }}
            - --model={{ $.Values.model.path }}
            - --device={{ $w.device }}
            - --cpu-math={{ $w.cpuMath | default "exact" }}
            - --page-size={{ $.Values.pageSize }}
            - --pool-pages={{ $w.poolPages }}
            - --mem-fraction={{ $w.memFraction }}
            - --chunked-prefill-size={{ $w.chunkedPrefillSize }}
            - --worker-id=$(POD_NAME)
            - --grpc-addr=0.0.0.0:{{ $w.grpcPort }}
            - --metrics-addr=0.0.0.0:{{ $w.metricsPort }}
            - --advertise-addr=$(POD_IP):{{ $w.grpcPort }}
            - --transfer={{ $w.transfer }}
            {{- include "ferry.etcdArgs" $ | nindent 12 }}
            - --etcd-lease-ttl={{ $.Values.etcd.leaseTtl }}
            - --transfer-addr=0.0.0.0:{{ $w.transferPort }}
            - --transfer-advertise-addr=$(POD_IP):{{ $w.transferPort }}
            {{- if eq .role "decode" }}
            - --max-running-requests={{ $w.maxRunningRequests }}
            - --drain-grace={{ $w.drainGrace }}
            {{- end }}
            {{- include "ferry.internalTlsArgs" (dict "ctx" $ "role" .role) | nindent 12 }}
            {{- with $.Values.otlpEndpoint }}
            - --otlp-endpoint={{ . }}
            {{- end }}
            {{- range $w.extraArgs }}
            - {{ . }}
            {{- end }}
          env:
            - name: POD_NAME
              valueFrom: {fieldRef: {fieldPath: metadata.name}}
            - name: POD_IP
              valueFrom: {fieldRef: {fieldPath: status.podIP}}
          ports:
            - {name: grpc, containerPort: {{ $w.grpcPort }}}
            - {name: metrics, containerPort: {{ $w.metricsPort }}}
            - {name: kv, containerPort: {{ $w.transferPort }}}
          # gRPC health: SERVING once the model is loaded and the pool touched; NOT_SERVING
          # while stopping. Under mutual TLS the kubelet cannot speak gRPC to the worker, so
          # `ferry health` asks it from inside the pod with the pod's own certificate.
          {{- $probe := printf "grpc: {port: %v}" $w.grpcPort }}
          {{- if ne $.Values.internalTls.mode "insecure" }}
          {{- $probe = printf "exec: {command: [ferry, health, --role=%s, --addr=127.0.0.1:%v, --timeout=4, --internal-tls-cert=/internal-tls/tls.crt, --internal-tls-key=/internal-tls/tls.key, --internal-tls-ca=/internal-tls/ca.crt, --internal-tls-server-name=%s]}" .role $w.grpcPort $.Values.internalTls.serverName }}
          {{- end }}
          startupProbe:
            {{ $probe }}
            periodSeconds: 5
            timeoutSeconds: 5
            failureThreshold: 120
          readinessProbe:
            {{ $probe }}
            periodSeconds: 5
            timeoutSeconds: 5
          livenessProbe:
            {{ $probe }}
            periodSeconds: 10
            timeoutSeconds: 5
            failureThreshold: 6
          resources:
            {{- $res := deepCopy ($w.resources | default dict) }}
            {{- $limits := get $res "limits" | default dict }}
            {{- if $w.gpu.enabled }}
            {{- $_ := set $limits $w.gpu.resourceName $w.gpu.count }}
            {{- end }}
            {{- if $w.rdma.enabled }}
            {{- $_ := set $limits $w.rdma.resourceName $w.rdma.count }}
            {{- end }}
            {{- if $limits }}
            {{- $_ := set $res "limits" $limits }}
            {{- end }}
            {{- toYaml $res | nindent 12 }}
          securityContext:
            {{- include "ferry.securityContext" (dict "rdma" $w.rdma.enabled) | nindent 12 }}
          volumeMounts:
            - {name: model, mountPath: /models, readOnly: true}
            - {name: tmp, mountPath: /tmp}
            {{- include "ferry.internalTlsMount" (dict "ctx" $ "role" .role) | nindent 12 }}
            {{- include "ferry.etcdMounts" $ | nindent 12 }}
            {{- if $w.shm.enabled }}
            - {name: shm, mountPath: /dev/shm}
            {{- end }}
      volumes:
        - name: model
          {{- include "ferry.modelVolume" $ | nindent 10 }}
        - name: tmp
          emptyDir: {}
        {{- include "ferry.internalTlsVolume" (dict "ctx" $ "role" .role) | nindent 8 }}
        {{- include "ferry.etcdVolumes" $ | nindent 8 }}
        {{- if $w.shm.enabled }}
        - name: shm
          emptyDir: {medium: Memory, sizeLimit: {{ $w.shm.sizeLimit }}}
        {{- end }}
      {{- with $w.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $w.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $w.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
---
# Headless: the workers' metrics for the ServiceMonitor (placement goes through etcd).
apiVersion: v1
kind: Service
metadata:
  name: {{ $name }}
  labels:
    {{- include "ferry.labels" (dict "ctx" $ "component" .role) | nindent 4 }}
spec:
  clusterIP: None
  selector:
    {{- include "ferry.selector" (dict "ctx" $ "component" .role) | nindent 4 }}
  ports:
    - {name: grpc, port: {{ $w.grpcPort }}, targetPort: grpc}
    - {name: metrics, port: {{ $w.metricsPort }}, targetPort: metrics}
{{- end -}}
