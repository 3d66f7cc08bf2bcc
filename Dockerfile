# syntax=docker/dockerfile:1.7
#
# osmo: one static binary; every service is a subcommand of it, so one image
# runs them all (docker-compose.yml and deploy/ pick the subcommand):
#
#   docker build -t osmo:local \
#     --build-arg VERSION=$(git describe --tags --always --dirty) \
#     --build-arg COMMIT=$(git rev-parse HEAD) \
#     --build-arg DATE=$(date -u +%Y-%m-%dT%H:%M:%SZ) .
#   docker run --rm -p 9000:9000 osmo:local serve --workflow calculator
#
# The binary is built for the target platform from the build platform
# (docker buildx build --platform linux/amd64,linux/arm64 ...), without cgo, so
# the final image needs no libc.

ARG GO_VERSION=1.26

FROM --platform=$BUILDPLATFORM golang:${GO_VERSION} AS build
ARG TARGETOS
ARG TARGETARCH
ARG VERSION=dev
ARG COMMIT=unknown
ARG DATE=unknown
WORKDIR /src
# Modules first, in their own layer and cache, so a source change does not
# download them again.
COPY go.mod go.sum ./
RUN --mount=type=cache,target=/go/pkg/mod \
    go mod download
COPY . .
RUN --mount=type=cache,target=/go/pkg/mod \
    --mount=type=cache,target=/root/.cache/go-build \
    CGO_ENABLED=0 GOOS=${TARGETOS} GOARCH=${TARGETARCH} \
    go build -trimpath -buildvcs=false \
      -ldflags "-s -w -X 'github.com/osmo-rl/osmo/cli.Version=${VERSION} (commit ${COMMIT}, built ${DATE})'" \
      -o /out/osmo ./cmd/osmo
# The grader's journal lives here (a volume in compose, an emptyDir in
# Kubernetes). A new named volume copies the directory's owner from the image,
# so the non-root user can write to it.
RUN mkdir -p /out/var/lib/osmo

FROM gcr.io/distroless/static-debian12:nonroot
ARG VERSION=dev
ARG COMMIT=unknown
ARG DATE=unknown
LABEL org.opencontainers.image.title="osmo" \
      org.opencontainers.image.description="Go services that run LLM-agent rollouts for RL training and grade them (rollout, grader, gateway, LLM proxy)" \
      org.opencontainers.image.source="https://github.com/osmo-rl/osmo" \
      org.opencontainers.image.url="https://github.com/osmo-rl/osmo" \
      org.opencontainers.image.documentation="https://github.com/osmo-rl/osmo/blob/main/docs/deploy.md" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${COMMIT}" \
      org.opencontainers.image.created="${DATE}"
COPY --from=build /out/osmo /osmo
COPY --from=build --chown=65532:65532 /out/var/lib/osmo /var/lib/osmo
# nonroot of the distroless image; numeric so Kubernetes' runAsNonRoot can
# verify it without reading /etc/passwd.
USER 65532:65532
# Ports of the subcommands' defaults:
#   9000  gateway / serve: REST, Connect, gRPC-Web and gRPC over h2c; GET /health, GET /metrics
#   9090  rollout: gRPC (grpc.health.v1 included)
#   9091  grader: gRPC (grpc.health.v1 included)
#   9002  llmproxy: OpenAI-compatible HTTP; GET /health
#   9003  mockllm: OpenAI-compatible policy double; GET /health
#   9464  rollout --metrics-addr: GET /metrics
#   9465  grader --metrics-addr: GET /metrics
EXPOSE 9000 9090 9091 9002 9003 9464 9465
# The default command listens on every interface, so it needs a key:
#   docker run -e OSMO_API_KEY=... -p 9000:9000 osmo:local
# No shell in this image: health checks run the binary itself, e.g.
#   ["CMD", "/osmo", "health", "127.0.0.1:9090"]             (gRPC health)
#   ["CMD", "/osmo", "health", "http://127.0.0.1:9000/health"] (HTTP)
ENTRYPOINT ["/osmo"]
CMD ["serve", "-p", "9000", "-H", "0.0.0.0"]
