# syntax=docker/dockerfile:1
# Multi-stage build of both binaries: idemgate (the gateway) and idemgate-reconciler.
# No Docker engine runs where idemgate is developed, so this file is kept simple and
# conventional; the Helm chart expects the image it builds.

FROM rust:1-bookworm AS build
WORKDIR /src
# 1. Dependencies only, cached until a manifest or the lock file changes.
COPY Cargo.toml Cargo.lock ./
COPY libs/auth/Cargo.toml libs/auth/
COPY libs/config/Cargo.toml libs/config/
COPY libs/core/Cargo.toml libs/core/
COPY libs/postgres/Cargo.toml libs/postgres/
COPY libs/redis/Cargo.toml libs/redis/
COPY libs/telemetry/Cargo.toml libs/telemetry/
COPY libs/testkit/Cargo.toml libs/testkit/
COPY libs/upstream/Cargo.toml libs/upstream/
COPY services/gateway/Cargo.toml services/gateway/
COPY services/payments-demo/Cargo.toml services/payments-demo/
COPY services/reconciler/Cargo.toml services/reconciler/
RUN for d in libs/auth libs/config libs/core libs/postgres libs/redis libs/telemetry libs/testkit libs/upstream; do \
      mkdir -p $d/src && echo '' > $d/src/lib.rs; done \
 && for d in services/gateway services/payments-demo services/reconciler; do \
      mkdir -p $d/src && echo 'fn main() {}' > $d/src/main.rs && echo '' > $d/src/lib.rs; done \
 && cargo build --release --locked -p idemgate -p idemgate-reconciler \
 && rm -rf libs/*/src services/*/src
# 2. The sources (migrations are embedded into the binary at build time).
COPY libs libs
COPY services services
COPY migrations migrations
RUN find libs services -name '*.rs' -exec touch {} + \
 && cargo build --release --locked -p idemgate -p idemgate-reconciler

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /src/target/release/idemgate /usr/local/bin/idemgate
COPY --from=build /src/target/release/idemgate-reconciler /usr/local/bin/idemgate-reconciler
USER 65532:65532
EXPOSE 8080 9091
ENTRYPOINT ["/usr/local/bin/idemgate"]
CMD ["serve", "--config", "/etc/idemgate/idemgate.toml"]
